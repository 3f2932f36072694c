"""The on-disk cache (``spec_decode.disk_cache``) through ``fixtures.smollm2_target_dir``, its one converting
caller: the marker's content check, the temporaries of killed conversions, the cache root's errors, the
umask of entries and the older variable.

A small fake GGUF file and a fake converter stand in for the real model: the cache's code path is the
same, and no model is needed. The real conversion is tested in models/test_gguf.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import stat
import subprocess
import sys
import time
import types
import warnings

import pytest

from spec_decode import disk_cache, fixtures
from spec_decode.models import gguf

WEIGHTS = bytes(range(256)) * 64   # the fake checkpoint's weights, 16 KiB
NAN_F32 = b"\x00\x00\xc0\x7f"
POSIX = pytest.mark.skipif(os.name != "posix", reason="forks a writer and signals it")


class FakeConverter:
    """``save_gguf_as_hf_dir``'s stand-in: the source's bytes become ``model.safetensors``; ``during``
    runs once the files are written (to kill or hold a conversion mid-way)."""

    def __init__(self):
        self.calls = 0
        self.during = None

    def __call__(self, source, out_dir):
        self.calls += 1
        (out_dir / "config.json").write_text('{"num_hidden_layers": 1}')
        (out_dir / "model.safetensors").write_bytes(source.read_bytes())
        if self.during is not None:
            self.during(out_dir)


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """A fresh cache root under ``tmp_path`` named by ``$SAFESPEC_CACHE``, a fake source and converter;
    ``entry`` is where the conversion lands."""
    source = tmp_path / "fake.gguf"
    source.write_bytes(WEIGHTS)
    monkeypatch.setenv(disk_cache.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(disk_cache.LEGACY_CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))   # nothing reaches the user's own cache
    monkeypatch.setattr(fixtures, "smollm2_gguf_path", lambda: source)
    converter = FakeConverter()
    monkeypatch.setattr(gguf, "save_gguf_as_hf_dir", converter)
    root = tmp_path / "cache"
    return types.SimpleNamespace(root=root, entry=root / fixtures.SMOLLM2_CACHE_NAME, converter=converter)


def _hidden(root):
    """The temporaries (hidden names) under the cache root."""
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def _edit_in_place(path, restore_mtime=False):
    """Overwrite bytes in the middle of ``path``, keeping its size (and, optionally, its mtime)."""
    before = path.stat()
    with open(path, "r+b") as f:
        f.seek(len(WEIGHTS) // 2)
        f.write(NAN_F32 * 64)
    if restore_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size


# ---------------------------------------------------------------- the marker checks the content
def test_a_file_edited_in_place_is_redone(cache):
    d = fixtures.smollm2_target_dir()
    _edit_in_place(d / "model.safetensors")
    assert fixtures.smollm2_target_dir() == d
    assert (d / "model.safetensors").read_bytes() == WEIGHTS
    assert cache.converter.calls == 2


def test_an_edit_that_kept_the_mtime_is_caught_on_request(cache):
    d = fixtures.smollm2_target_dir()
    _edit_in_place(d / "model.safetensors", restore_mtime=True)
    fixtures.smollm2_target_dir()               # the cheap check: size and mtime agree, no hashing
    assert cache.converter.calls == 1
    assert fixtures.smollm2_target_dir(verify=True) == d
    assert (d / "model.safetensors").read_bytes() == WEIGHTS
    assert cache.converter.calls == 2


def test_a_touched_but_unchanged_file_is_kept(cache):
    d = fixtures.smollm2_target_dir()
    os.utime(d / "model.safetensors", ns=(1, 1))   # a copy without -p: the hash says it is the same
    assert fixtures.smollm2_target_dir() == d
    assert fixtures.smollm2_target_dir(verify=True) == d
    assert cache.converter.calls == 1


def test_the_marker_records_each_files_sha256(cache):
    d = fixtures.smollm2_target_dir()
    files = json.loads((d / fixtures.CACHE_MARKER).read_text())["files"]
    assert set(files) == {"config.json", "model.safetensors"}
    for name, meta in files.items():
        data = (d / name).read_bytes()
        assert meta["size"] == len(data) and meta["sha256"] == hashlib.sha256(data).hexdigest()


def test_a_sizes_only_marker_of_an_older_version_is_redone(cache):
    d = fixtures.smollm2_target_dir()
    marker = json.loads((d / fixtures.CACHE_MARKER).read_text())
    marker["files"] = {name: meta["size"] for name, meta in marker["files"].items()}
    (d / fixtures.CACHE_MARKER).write_text(json.dumps(marker))
    fixtures.smollm2_target_dir()
    assert cache.converter.calls == 2
    assert "sha256" in json.loads((d / fixtures.CACHE_MARKER).read_text())["files"]["model.safetensors"]


# ---------------------------------------------------------------- temporaries of killed conversions
def _fork(body) -> int:
    """Run ``body`` in a forked child that never returns into pytest (exit 0 when it returns); its pid."""
    pid = os.fork()
    if pid == 0:   # pragma: no cover (the child)
        code = 1
        try:
            body()
            code = 0
        finally:
            os._exit(code)
    return pid


def _wait_readable(fd, what):
    if not select.select([fd], [], [], 120)[0]:
        pytest.fail(f"the child did not {what} within 120 s")


@POSIX
def test_a_conversion_killed_mid_way_leaves_nothing_after_the_next_call(cache):
    def killed():
        cache.converter.during = lambda out: os.kill(os.getpid(), signal.SIGKILL)
        fixtures.smollm2_target_dir()

    _, status = os.waitpid(_fork(killed), 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert len(_hidden(cache.root)) == 1          # what the killed conversion left
    assert fixtures.smollm2_target_dir() == cache.entry
    assert _hidden(cache.root) == []


@POSIX
def test_a_running_conversions_temporary_is_left_alone(cache):
    started_r, started_w = os.pipe()
    go_r, go_w = os.pipe()

    def held():
        def hold(out):
            os.write(started_w, b"1")
            os.read(go_r, 1)
        cache.converter.during = hold
        fixtures.smollm2_target_dir()

    pid = _fork(held)
    try:
        _wait_readable(started_r, "start converting")
        running = _hidden(cache.root)
        assert len(running) == 1
        assert fixtures.smollm2_target_dir() == cache.entry   # a second writer, concurrent
        assert _hidden(cache.root) == running
    finally:
        os.write(go_w, b"1")
        _, status = os.waitpid(pid, 0)
        for fd in (started_r, started_w, go_r, go_w):
            os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0   # it finished, found the entry in place and kept it
    assert _hidden(cache.root) == []
    assert (cache.entry / "model.safetensors").read_bytes() == WEIGHTS


def test_temporaries_without_a_running_writer_here_go_by_age(tmp_path):
    old = time.time() - disk_cache.STALE_AFTER_S - 60
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    here = disk_cache.temporary_name("entry").split(".")[2]
    paths = {
        "dead writer here": f".entry-tmp.{here}.{dead}.0badcafe",
        "this process": disk_cache.temporary_name("entry"),
        "other host, recent": ".entry-tmp.otherhost.12345.0badcafe",
        "other host, old": ".entry-tmp.otherhost.12346.0badcafe",
        "an older version's, old": ".entry-ab_cd123",
        "an older version's, recent": ".entry-xy_zw789",
        "not a temporary, old": ".entry-notes",
        "another entry's, old": ".other-tmp.otherhost.12346.0badcafe",
    }
    for label, name in paths.items():
        (tmp_path / name).mkdir()
        if label.endswith(", old"):
            os.utime(tmp_path / name, (old, old))
    removed = {p.name for p in disk_cache.remove_stale_temporaries(tmp_path, "entry")}
    gone = {label for label, name in paths.items() if not (tmp_path / name).exists()}
    assert removed == {paths[label] for label in gone}
    assert gone == {"dead writer here", "other host, old", "an older version's, old"}


# ---------------------------------------------------------------- the cache root
def test_a_cache_path_that_is_a_file_is_an_error_naming_the_variable(cache, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(disk_cache.CACHE_ENV, str(blocker))
    with pytest.raises(OSError, match=r"a-file \(\$SAFESPEC_CACHE\): a file is there.*set \$SAFESPEC_CACHE to a "
                                      r"directory you can write"):
        fixtures.smollm2_target_dir()


def test_a_cache_path_under_a_file_is_an_error_naming_the_variable(cache, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(disk_cache.CACHE_ENV, str(blocker / "cache"))
    with pytest.raises(OSError, match=r"\(\$SAFESPEC_CACHE\): cannot be created.*set \$SAFESPEC_CACHE"):
        fixtures.smollm2_target_dir()


def test_an_unusable_default_names_the_variable_to_set(cache, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.delenv(disk_cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    with pytest.raises(disk_cache.CacheDirError, match=r"the default, \$SAFESPEC_CACHE being unset.*set "
                                                       r"\$SAFESPEC_CACHE to a directory you can write"):
        fixtures.smollm2_target_dir()


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes anywhere")
def test_an_unwritable_cache_is_an_error_naming_the_variable(cache):
    cache.root.mkdir()
    cache.root.chmod(0o555)
    try:
        with pytest.raises(OSError, match=r"\(\$SAFESPEC_CACHE\): is not writable"):
            fixtures.smollm2_target_dir()
    finally:
        cache.root.chmod(0o755)


@pytest.mark.skipif(os.name != "posix", reason="POSIX modes")
@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077], ids=lambda u: f"umask-{u:03o}")
def test_entries_keep_the_users_umask(cache, umask):
    old = os.umask(umask)
    try:
        d = fixtures.smollm2_target_dir()
    finally:
        os.umask(old)
    assert stat.S_IMODE(d.stat().st_mode) == 0o777 & ~umask
    for f in d.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f.name


def test_the_older_variable_still_names_the_cache_with_a_deprecation_warning(cache, monkeypatch, tmp_path):
    monkeypatch.delenv(disk_cache.CACHE_ENV)
    monkeypatch.setenv(disk_cache.LEGACY_CACHE_ENV, str(tmp_path / "legacy"))
    with pytest.warns(DeprecationWarning, match=r"\$SAFESPEC_CACHE_DIR is deprecated \(set \$SAFESPEC_CACHE"):
        d = fixtures.smollm2_target_dir()
    assert d == tmp_path / "legacy" / fixtures.SMOLLM2_CACHE_NAME and (d / fixtures.CACHE_MARKER).is_file()


def test_the_newer_variable_wins_over_the_older_one(cache, monkeypatch, tmp_path):
    monkeypatch.setenv(disk_cache.LEGACY_CACHE_ENV, str(tmp_path / "legacy"))
    with pytest.warns(DeprecationWarning, match="ignored, as .SAFESPEC_CACHE is set"):
        assert fixtures.smollm2_target_dir() == cache.entry
    assert not (tmp_path / "legacy").exists()


def test_one_variable_names_the_cache_without_warnings(cache):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert disk_cache.cache_dir() == fixtures.cache_dir() == cache.root
