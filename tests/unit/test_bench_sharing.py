"""The smoke's shared launches (benchmarks.launch.sharing): one launch per workload inside the block,
a fresh one for each request outside it."""

from __future__ import annotations

from benchmarks import launch


def test_a_workload_is_launched_once_while_sharing_and_every_time_outside():
    launched = []

    def launch_once(tag):
        launched.append(tag)
        return {"tag": tag, "n": len(launched)}

    with launch.sharing():
        first = launch._once(["torchrun", launch.SMOKE_SPEC, 2], lambda: launch_once("a"))
        again = launch._once(["torchrun", dict(reversed(launch.SMOKE_SPEC.items())), 2], lambda: launch_once("b"))
        other = launch._once(["torchrun", launch.SMOKE_SPEC, 1], lambda: launch_once("c"))
    assert again is first and other is not first and launched == ["a", "c"]
    assert launch._shared is None  # the block's records are gone with it
    launch._once(["torchrun", launch.SMOKE_SPEC, 2], lambda: launch_once("d"))
    launch._once(["torchrun", launch.SMOKE_SPEC, 2], lambda: launch_once("e"))
    assert launched == ["a", "c", "d", "e"]
