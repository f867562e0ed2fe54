"""pipetrain-prepare reads what data=datasets reads, through `datasets` (files and folders written by
`datasets` itself), and refuses a binary file read as text in one line (#46: an .arrow file used to
"succeed" with garbage tokens, and a hub-layout folder read only its README)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipetrain.config.shards import read_shard
from pipetrain.prepare import main, prepare

datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.pure

DOCS = [f"document {i} says " + "something " * (i % 5) for i in range(300)]


def quiet(_: str) -> None:
    pass


def streams(out: Path) -> np.ndarray:
    """A prepared folder's train then val tokens."""
    shards = [read_shard(f, knob="x") for s in ("train", "val") for f in sorted(out.glob(f"{s}_*.bin"))]
    return np.concatenate([np.fromfile(s.path, dtype=s.dtype, offset=s.offset) for s in shards])


def test_every_datasets_input_gives_the_shards_of_the_same_jsonl(tmp_path):
    ds = datasets.Dataset.from_dict({"text": DOCS, "n": list(range(len(DOCS)))})
    ds.to_json(tmp_path / "docs.jsonl")
    ds.save_to_disk(tmp_path / "saved")
    (tmp_path / "hub" / "data").mkdir(parents=True)
    (tmp_path / "hub" / "README.md").write_text("---\nlicense: mit\n---\n# a dataset card, not a document\n")
    ds.to_parquet(tmp_path / "hub" / "data" / "train-00000-of-00001.parquet")
    ds.to_csv(tmp_path / "docs.csv", index=False)
    inputs = {"saved": tmp_path / "saved", "hub-layout": tmp_path / "hub", "csv": tmp_path / "docs.csv",
              "arrow": next((tmp_path / "saved").glob("*.arrow"))}
    prepare([str(tmp_path / "docs.jsonl")], str(tmp_path / "out-jsonl"), val_min_tokens=50, note=quiet)
    want = streams(tmp_path / "out-jsonl")
    for kind, path in inputs.items():
        prepare([str(path)], str(tmp_path / f"out-{kind}"), val_min_tokens=50, note=quiet)
        assert np.array_equal(streams(tmp_path / f"out-{kind}"), want), kind


def test_a_binary_file_read_as_text_is_refused_in_one_line(tmp_path, capsys):
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(tmp_path / "saved")
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    renamed = tmp_path / "corpus.txt"
    renamed.write_bytes(arrow.read_bytes())
    for argv in ([str(arrow), "--format", "text"], [str(renamed)]):
        with pytest.raises(SystemExit) as info:
            main([*argv, "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err.strip()
        assert info.value.code == 2 and "\n" not in err and "is not text (a NUL byte at offset" in err, err
    assert not (tmp_path / "out").exists()


def test_a_missing_field_in_a_saved_dataset_names_the_fields(tmp_path):
    datasets.Dataset.from_dict({"body": DOCS}).save_to_disk(tmp_path / "saved")
    with pytest.raises(ValueError) as info:
        prepare([str(tmp_path / "saved")], str(tmp_path / "out"), note=quiet)
    assert "\n" not in str(info.value) and "'text'" in str(info.value) and "fields: body" in str(info.value)
