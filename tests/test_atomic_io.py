"""atomic_write: the target appears whole or not at all; a failed write leaves nothing behind."""
import pytest

from dspark.atomic_io import atomic_write


def test_atomic_write_replaces_whole_or_leaves_old(tmp_path):
    path = tmp_path / "f.bin"
    atomic_write(path, lambda f: f.write(b"old"))

    def torn(f):
        f.write(b"half of the new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, torn)
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]
    atomic_write(path, lambda f: f.write("new"), binary=False)
    assert path.read_text() == "new"
