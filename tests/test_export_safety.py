"""mode=export loses nothing it did not create: a non-empty export.dir is refused in one line
naming export.overwrite (its files intact), a path that is a file is refused (the file intact),
model.pretrained's folder is never replaced (its README.md intact, even with export.overwrite=true),
export.overwrite=true replaces a folder whole, and a failed export leaves no temporary folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_cli
from test_hf_io import TIED, Folders
from pipetrain.train.export import run_export

pytest.importorskip("transformers", reason="the test extra: pip install -e '.[test]'")
# the smallest llama-tiny (the default's shapes but one layer): a few ms to write
TINY = ["mode=export", "model=llama-tiny", "model.num_hidden_layers=1", "model.hidden_size=32",
        "model.intermediate_size=64", "model.num_attention_heads=2", "model.num_key_value_heads=2"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return Folders(tmp_path_factory.mktemp("hf"))


def export(compose, tmp_path: Path, *overrides: str) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    return run_export(compose([*TINY, *overrides]), run_dir, note=lambda _: None)


def refused(compose, tmp_path: Path, *overrides: str) -> str:
    with pytest.raises(ValueError) as err:
        export(compose, tmp_path, *overrides)
    assert "\n" not in str(err.value)
    return str(err.value)


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def no_leftovers(parent: Path) -> None:
    assert not [p.name for p in parent.iterdir() if p.name.startswith(".")], "a temporary folder was left"


@pytest.mark.pure
def test_non_empty_folder_is_refused_unless_overwrite(compose, tmp_path):
    out = tmp_path / "mine"
    (out / "notes").mkdir(parents=True)
    (out / "notes" / "a.txt").write_text("keep me")
    (out / "model.safetensors").write_bytes(b"not ours")
    before = tree(out)
    msg = refused(compose, tmp_path, f"export.dir={out}")
    assert "is not empty" in msg and "export.overwrite=true" in msg and str(out) in msg
    assert tree(out) == before
    no_leftovers(tmp_path)
    export(compose, tmp_path, f"export.dir={out}", "export.overwrite=true")  # told to: replaced whole
    assert "config.json" in tree(out) and "notes/a.txt" not in tree(out)
    no_leftovers(tmp_path)


@pytest.mark.pure
def test_empty_or_new_folder_is_written(compose, tmp_path):
    (tmp_path / "empty").mkdir()
    for name in ("empty", "new/deeper"):
        out = export(compose, tmp_path, f"export.dir={tmp_path / name}")
        assert "config.json" in tree(out) and "model.safetensors.index.json" in tree(out)
        assert out.stat().st_mode & 0o777 == (tmp_path / "run").stat().st_mode & 0o777  # as mkdir makes a folder
    no_leftovers(tmp_path)
    no_leftovers(tmp_path / "new")


@pytest.mark.pure
def test_a_file_is_refused_and_kept(compose, tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\x00\x01precious")
    for overrides in ([f"export.dir={f}"], [f"export.dir={f}", "export.overwrite=true"], [f"export.dir={f}/hf"]):
        msg = refused(compose, tmp_path, *overrides)
        assert "a file" in msg and "name a new or empty folder" in msg
    assert f.read_bytes() == b"\x00\x01precious"
    no_leftovers(tmp_path)


@pytest.mark.pure
def test_pretrained_folder_is_never_replaced(folders, compose, tmp_path):
    src = tmp_path / "pretrained"
    import shutil

    shutil.copytree(folders[TIED], src)
    (src / "README.md").write_text("# my model card\n")
    before = tree(src)
    for overrides in ([], ["export.overwrite=true"]):  # into it; into the folder holding it
        msg = refused(compose, tmp_path, f"model.pretrained={src}", f"export.dir={src}", *overrides)
        assert "is model.pretrained's folder" in msg and "export into another folder" in msg
        msg = refused(compose, tmp_path, f"model.pretrained={src}", f"export.dir={tmp_path}", *overrides)
        assert f"holds {src.resolve()}, model.pretrained's folder" in msg
    assert tree(src) == before
    no_leftovers(tmp_path)


@pytest.mark.e2e
def test_cli_refuses_non_empty_folder_in_one_line(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "a.txt").write_text("keep me")
    res = run_cli([*TINY, f"export.dir={out}", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "export.overwrite=true" in lines[0], res.stderr[-2000:]
    assert tree(out) == {"a.txt": b"keep me"}
