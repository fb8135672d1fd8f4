"""``rayjobs data prepare``: the bundled digits, a folder of CSV files or of text files, written as
Parquet shards (``OUT/{train,val,test}/part-*.parquet``) with ``OUT/rayjobs-data.json`` naming the
columns, so that ``--set data.name=parquet --set data.kwargs.path=OUT`` trains on them as they are."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from rayjobs.errors import ConfigError
from rayjobs.preflight import check_writable_dir
from rayjobs.ray_data import META, SPLITS

FRACTIONS = (0.7, 0.15, 0.15)  # train, val, test of a CSV or text source


def check_out(out: Path) -> None:
    """``--out`` must be new, empty, or a folder this command wrote before (its old shards are replaced)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"data prepare: --out {out} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / META).is_file():
        raise ConfigError(
            f"data prepare: --out {out} holds files that `rayjobs data prepare` did not write; give a new or empty folder"
        )
    check_writable_dir(str(out), "data prepare: --out")


def _write(out: Path, tables: dict[str, Any], meta: dict[str, Any], shards: int) -> dict[str, int]:
    import pyarrow.parquet as pq

    check_out(out)
    for old in out.glob("*/part-*.parquet"):  # an earlier prepare's shards: the next run would read them too
        old.unlink()
    rows = {}
    for split, table in tables.items():
        folder = out / split
        folder.mkdir(parents=True, exist_ok=True)
        n = shards if split == "train" else 1
        bounds = np.linspace(0, table.num_rows, n + 1).astype(int)
        for i in range(n):
            pq.write_table(table.slice(bounds[i], bounds[i + 1] - bounds[i]), folder / f"part-{i:05d}.parquet")
        rows[split] = table.num_rows
    (out / META).write_text(json.dumps({**meta, "format": "parquet", "rows": rows}, indent=2))
    return rows


def _split(n: int, src: Path, what: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Row indices of train, val and test (70/15/15); too few rows for a row in each is one line."""
    perm = np.random.default_rng(seed).permutation(n)
    a, b = int(n * FRACTIONS[0]), int(n * (FRACTIONS[0] + FRACTIONS[1]))
    if not 0 < a < b < n:
        raise ConfigError(
            f"data prepare: {src} gives {n} {what}: too few to split 70/15/15 into train, val and test "
            "with one in each; give at least 4"
        )
    return dict(zip(SPLITS, (perm[:a], perm[a:b], perm[b:])))


def digits(out: Path, shards: int = 4) -> dict[str, int]:
    """The bundled digits with the bundled loader's split: ``image`` (64 floats) and ``label``."""
    import pyarrow as pa

    from rayjobs.data import digits as load_digits

    splits = load_digits()
    tables = {}
    for split, ds in zip(SPLITS, (splits.train, splits.val, splits.test)):
        x, y = ds.tensors
        images = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(len(x), -1).numpy().ravel()), 64)
        tables[split] = pa.table({"image": images, "label": pa.array(y.numpy())})
    meta = {"kind": "image", "features": ["image"], "label": "label", "shape": [1, 8, 8], "num_classes": 10}
    return _write(out, tables, meta, shards)


def _sources(src: Path, suffixes: tuple[str, ...], what: str) -> list[Path]:
    if not src.exists():
        raise ConfigError(f"data prepare: no such file or directory: {src}")
    files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.suffix.lower() in suffixes)
    if not files:
        raise ConfigError(f"data prepare: no {what} files ({'/'.join(suffixes)}) under {src}")
    return files


def csv(src: Path, out: Path, label: str = "label", shards: int = 4) -> dict[str, int]:
    """CSV files with a header: every column kept; ``label`` must be an integer column."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pcsv

    tables = []
    for f in _sources(src, (".csv",), "CSV"):
        try:
            tables.append(pcsv.read_csv(f))
        except Exception as exc:  # noqa: BLE001 - a malformed file is the user's to fix
            raise ConfigError(f"data prepare: cannot read {f} as CSV: {str(exc).splitlines()[0]}") from None
    try:
        table = pa.concat_tables(tables, promote_options="default")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise ConfigError(
            f"data prepare: the CSV files under {src} do not share one schema ({str(exc).splitlines()[0]}); "
            "give files with the same columns and types"
        ) from None
    if label not in table.column_names:
        raise ConfigError(
            f"data prepare: no column {label!r} in {src} (columns: {', '.join(table.column_names)}); use --label"
        )
    if not pa.types.is_integer(table[label].type):
        raise ConfigError(f"data prepare: label column {label!r} must hold integers, got {table[label].type}")
    features = [c for c in table.column_names if c != label]
    meta = {
        "kind": "image",
        "features": features,
        "label": label,
        "shape": [len(features)],
        "num_classes": int(pc.max(table[label]).as_py()) + 1,
    }
    splits = _split(table.num_rows, src, "row(s)")
    return _write(out, {s: table.take(idx) for s, idx in splits.items()}, meta, shards)


def text(src: Path, out: Path, seq_len: int = 128, shards: int = 4) -> dict[str, int]:
    """Text files as bytes (the byte-level tokenizer), packed per file into ``seq_len`` + 1 tokens."""
    import pyarrow as pa

    chunks = []
    for f in _sources(src, (".txt", ".text", ".md"), "text"):
        tokens = np.frombuffer(f.read_bytes(), dtype=np.uint8).astype(np.int16)
        usable = len(tokens) // (seq_len + 1) * (seq_len + 1)
        if usable:
            chunks.append(tokens[:usable].reshape(-1, seq_len + 1))
    if not chunks:
        raise ConfigError(f"data prepare: the text under {src} is shorter than one sequence of {seq_len + 1} bytes")
    seqs = np.concatenate(chunks)
    table = pa.table({"tokens": pa.FixedSizeListArray.from_arrays(pa.array(seqs.ravel()), seq_len + 1)})
    meta = {"kind": "tokens", "features": ["tokens"], "seq_len": seq_len, "vocab_size": 256}
    splits = _split(table.num_rows, src, f"sequence(s) of {seq_len + 1} bytes")
    return _write(out, {s: table.take(idx) for s, idx in splits.items()}, meta, shards)
