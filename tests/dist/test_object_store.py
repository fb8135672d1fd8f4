"""run.storage_path on an object store: checkpoints go to an S3 bucket (a local S3 server) and resume from it.

The bucket is served by moto's S3 server on 127.0.0.1 and reached through pyarrow's S3 filesystem,
the same code path as a real bucket (endpoint_override in the URI's query).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import VENV_BIN, free_port, spawn_ranks

from rayjobs import checkpoint as ckpt
from rayjobs.config import from_dict, load_config
from rayjobs.context import WorkerContext
from rayjobs.errors import ConfigError
from rayjobs.rundir import read_history
from rayjobs.storage.bucket import RunStore, StoreError

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "rayjobs-test", "AWS_SECRET_ACCESS_KEY": "rayjobs-test-secret"}


@pytest.fixture(scope="module")
def s3():
    """A local S3 endpoint (moto's server) with one bucket; yields a URI factory for prefixes in it."""
    import os
    import socket

    port = free_port()
    proc = subprocess.Popen(
        [f"{VENV_BIN}/moto_server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
        assert time.monotonic() < deadline and proc.poll() is None, "moto_server did not start"
        time.sleep(0.2)
    query = f"endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    try:
        import pyarrow.fs as pafs

        fs, _ = pafs.FileSystem.from_uri(f"s3://rayjobs?{query}&allow_bucket_creation=true")
        fs.create_dir("rayjobs")
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    yield lambda prefix: f"s3://rayjobs/{prefix}?{query}"
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def cluster_credentials():
    """The bucket's credentials in this module's environment before its Ray starts (its nodes' role)."""
    import os

    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    yield
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture
def aws(monkeypatch):
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)


def test_config_takes_object_store_uris_and_refuses_credentials_in_them():
    cfg = from_dict({"run": {"storage_path": "s3://bucket/runs?endpoint_override=h:9000", "local_dir": "/tmp/x"}})
    assert cfg.storage_uri.startswith("s3://bucket/runs") and cfg.run_dir == "/tmp/x/digits_cnn-digits"
    assert from_dict({"run": {"storage_path": "gs://b/p"}}).storage_path.endswith(".cache/rayjobs/gs/b/p")
    assert from_dict({"run": {"storage_path": "results"}}).storage_uri == ""
    with pytest.raises(ConfigError, match=r"run.storage_path: .*must not carry credentials"):
        load_config(None, ["run.storage_path=s3://AKIA:secret@bucket/runs"])
    with pytest.raises(ConfigError, match=r"run.storage_path: .*must start with s3://"):
        load_config(None, ["run.storage_path=ftp://host/runs"])
    with pytest.raises(ConfigError, match=r"run.storage_path: .*names no bucket"):
        load_config(None, ["run.storage_path=s3:///runs"])
    with pytest.raises(ConfigError, match=r"^run.local_dir: is only used with an object store run.storage_path"):
        load_config(None, ["run.storage_path=results", "run.local_dir=/tmp/x"])


def _two_nodes_worker(rank: int, world: int, port: int, root: str, uri: str) -> None:
    """Two ranks as two nodes (each its own local directory, both local rank 0) saving to one bucket."""
    from test_ddp_gloo import CASES, _data, gpt_ddp

    from models import build_model
    from rayjobs import stepping
    from rayjobs.checkpoint import Saver, TrainState
    from rayjobs.parallel import wrap_ddp

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    ctx = replace(WorkerContext.from_process_group(), local_rank=0)
    local = Path(root, f"node{rank}")
    store = RunStore(uri, "run")
    model, opt, sched, cfg = gpt_ddp(ctx)
    info = CASES["gpt"][0]
    saver = Saver(str(local), ctx, {}, keep_last=2, async_save=True, store=store)
    for step, (x, y) in enumerate(_data("gpt")[:3], start=1):
        per = x.shape[0] // world
        stepping.train_step(
            model, [(x[rank * per : (rank + 1) * per].long(), y[rank * per : (rank + 1) * per])], opt, cfg, ctx
        )
        saver.save(step, model, opt, sched, None, TrainState(step=step), force_sync=step < 3)
    saver.wait()  # the async save of step 3 is uploaded here
    # Node 1 never saw rank 0's shards: it downloads them, and both ranks load the same weights.
    path = ckpt.fetch_latest(store, local, ctx)
    assert path == str(local / ckpt.name_for(3)), path
    fresh = wrap_ddp(build_model("gpt", "debug", {}, info), ctx)
    fresh_opt = stepping.build_optimizer(fresh, cfg)
    ckpt.load(path, fresh, fresh_opt, ctx)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    dist.barrier()


def test_two_nodes_upload_their_own_shards_and_each_resumes_from_the_bucket(s3, aws, tmp_path, capsys):
    uri = s3("gloo")
    spawn_ranks(_two_nodes_worker, 2, (str(tmp_path), uri))
    store = RunStore(uri, "run")
    assert ckpt.checkpoint_names(store) == [ckpt.name_for(2), ckpt.name_for(3)]  # keep_last=2 pruned step 1
    manifest = ckpt.read_manifest(store, ckpt.name_for(3))
    assert {"rank_0.pt", "rank_1.pt", ".metadata", "state.json"} <= set(manifest["files"])
    assert any(f.startswith("__1_") for f in manifest["files"]) and any(f.startswith("__0_") for f in manifest["files"])
    assert set(manifest["sizes"]) == set(manifest["files"])
    # Each node cached only what the bucket keeps.
    for node in ("node0", "node1"):
        assert sorted(p.name for p in (tmp_path / node).glob("checkpoint_*")) == [ckpt.name_for(2), ckpt.name_for(3)]

    # `rayjobs checkpoints` lists the bucket.
    from rayjobs import cli

    cli.main(["checkpoints", "run", "--storage-path", uri])
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in listed[1:]] == [["2", "complete"], ["3", "complete"]], listed
    assert listed[-1].split()[-1] == f"s3://rayjobs/gloo/run/{ckpt.name_for(3)}"

    # A damaged newest checkpoint is skipped, with a warning, for the one before it.
    one = WorkerContext(0, 1, 0, torch.device("cpu"))
    name = ckpt.name_for(3)
    victim = next(f for f in manifest["files"] if f.startswith("__0_"))
    size = manifest["sizes"][victim]
    store.write_bytes(f"{name}/{victim}", b"\0" * size)  # same size: only the sha256 tells
    got = ckpt.fetch_latest(store, tmp_path / "fresh", one)
    assert got == str(tmp_path / "fresh" / ckpt.name_for(2))
    # Without its manifest in the bucket a checkpoint is incomplete: not even downloaded.
    store.fs.delete_file(store.path(name, "manifest.json"))
    assert ckpt.problem(store, name).startswith("no manifest")
    shutil.rmtree(tmp_path / "fresh")
    assert ckpt.fetch_latest(store, tmp_path / "fresh", one) == str(tmp_path / "fresh" / ckpt.name_for(2))
    assert not (tmp_path / "fresh" / name).exists()


@pytest.mark.slow
def test_an_unreachable_bucket_is_one_line_naming_it(aws, tmp_path):
    from rayjobs import train

    port = free_port()  # nothing listens there
    uri = f"s3://rayjobs/x?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    cfg = load_config(None, [f"run.storage_path={uri}", f"run.local_dir={tmp_path}", "scaling.num_workers=0"])
    with pytest.raises(StoreError) as err:
        train.run(cfg)
    message = str(err.value)
    assert "\n" not in message and message.startswith("object store: cannot list s3://rayjobs/x/digits-ddp: ")
    assert "credentials" in message


@pytest.mark.ray
def test_ray_workers_checkpoint_to_the_bucket_and_a_new_node_resumes_from_it(
    s3, cluster_credentials, ray_cluster, tmp_path
):
    """2 Ray workers train to the bucket; the local directory is wiped (a new machine); the re-run resumes.

    The cluster's processes (Train's controller included) have the credentials, as nodes with an
    instance role or a job submitted with them in its runtime_env do.
    """
    from rayjobs import train

    uri = s3("ray")
    base = [f"run.storage_path={uri}", f"run.local_dir={tmp_path / 'local'}", "run.name=digits-s3"]
    base += ["scaling.num_workers=2", "training.eval_every=10", "tracking.enabled=false"]
    first = train.run(load_config(None, [*base, "training.epochs=1"]))
    steps = 1257 // 64
    assert first["metrics"]["step"] == steps
    assert first["checkpoint_uri"] == f"s3://rayjobs/ray/digits-s3/{ckpt.name_for(steps)}"
    store = RunStore(uri, "digits-s3")
    assert ckpt.problem(store, ckpt.name_for(steps)) == ""
    assert {"rank_0.pt", "rank_1.pt"} <= set(ckpt.read_manifest(store, ckpt.name_for(steps))["files"])

    shutil.rmtree(tmp_path / "local")
    second = train.run(load_config(None, [*base, "training.epochs=2"]))
    assert second["metrics"]["step"] == 2 * steps
    history = read_history(second["history"])
    assert min(h["step"] for h in history) > steps, history  # resumed from the bucket, not from step 0
    assert second["metrics"]["test/accuracy"] > 0.85
    assert Path(second["checkpoint"], "manifest.json").is_file()  # the driver's local copy, checked
    assert json.loads(store.read_bytes(f"{ckpt.name_for(2 * steps)}/state.json"))["step"] == 2 * steps


@pytest.mark.ray
def test_doctor_checks_the_bucket_from_every_node(s3, cluster_credentials, ray_cluster, tmp_path):
    from rayjobs import doctor

    checks = {c.name: c for c in doctor.run_checks(s3("doctor"), "", str(tmp_path))}
    assert checks["storage"].status == doctor.OK, checks["storage"]
    assert "read and written by 1 node(s)" in checks["storage"].detail

    away = f"s3://rayjobs/doctor?endpoint_override=127.0.0.1:{free_port()}&scheme=http&region=us-east-1"
    checks = {c.name: c for c in doctor.run_checks(away, "", str(tmp_path))}
    assert checks["storage"].status == doctor.FAIL
    assert checks["storage"].detail.startswith(f"run.storage_path {away}: the driver cannot write s3://rayjobs/")
