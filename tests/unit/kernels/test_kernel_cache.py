"""The compiled kernel's cache: a private folder under $ATTNRES_CACHE, checked before loading."""

from __future__ import annotations

import os
import shutil
import stat

import pytest

from attention_residuals.kernels import cpu


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A cache root in tmp_path and a kernel state as before the first use (restored after)."""
    monkeypatch.setenv("ATTNRES_CACHE", str(tmp_path / "root"))
    monkeypatch.delenv("ATTNRES_NO_COMPILE", raising=False)
    monkeypatch.setattr(cpu, "_state", {})
    return tmp_path / "root" / "kernels"


def _spy_loads(monkeypatch):
    """Record every library the loader would dlopen, and every build (none happens)."""
    loaded, built = [], []

    def fake_cdll(path):
        loaded.append(str(path))
        raise OSError("not loading in this test")

    monkeypatch.setattr(cpu.ctypes, "CDLL", fake_cdll)
    monkeypatch.setattr(cpu, "_compiler", lambda: "cc")
    monkeypatch.setattr(cpu, "_compile", lambda cc, out, native, openmp: built.append(out) or "no build here")
    return loaded, built


def test_the_cache_is_a_0700_folder_under_the_one_cache_root(fresh):
    assert cpu.cache_root() == fresh.parent
    assert cpu._cache_dir() == fresh
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700 and cpu.cache_dir_problem(fresh) is None


@pytest.mark.parametrize("how", ["open to others", "a symlink", "another owner"])
def test_a_cache_folder_not_ours_alone_is_never_loaded_from(fresh, monkeypatch, tmp_path, how):
    if how == "a symlink":
        elsewhere = tmp_path / "attacker"
        elsewhere.mkdir(mode=0o700)
        fresh.parent.mkdir(parents=True)
        fresh.symlink_to(elsewhere)
    else:
        fresh.mkdir(parents=True, mode=0o700)
        if how == "open to others":
            fresh.chmod(0o777)
        else:
            uid = os.getuid()
            monkeypatch.setattr(cpu, "_uid", lambda: uid + 1)
    loaded, built = _spy_loads(monkeypatch)
    planted = [fresh / cpu._library_name("cc", n, o) for n in (True, False) for o in (True, False)]
    for p in planted:
        p.write_bytes(b"\x7fELF planted")
    with pytest.warns(
        UserWarning, match="kernel cache .*kernels (has mode 0o777|is not a folder|is owned by uid)"
    ):
        assert cpu.unavailable_reason() is not None
    assert not set(loaded) & {str(p) for p in planted}
    assert built and all(
        b.parent != fresh and b.parent.name.startswith("attention_residuals-kernels-") for b in built
    )
    assert stat.S_IMODE(os.stat(built[0].parent).st_mode) == 0o700  # the private folder used instead


def test_a_cached_file_not_ours_or_not_regular_is_not_loaded(fresh, monkeypatch, tmp_path):
    fresh.mkdir(parents=True, mode=0o700)
    target = tmp_path / "evil.so"
    target.write_bytes(b"x")
    loaded, _ = _spy_loads(monkeypatch)
    for native in (True, False):
        for openmp in (True, False):
            (fresh / cpu._library_name("cc", native, openmp)).symlink_to(target)
    assert "is not a regular file" in cpu.unavailable_reason()
    assert loaded == []


@pytest.fixture(scope="module")
def real_library():
    """The library this machine builds (in the real cache, before ``fresh`` swaps the state)."""
    path = cpu.library_path()
    if path is None:
        pytest.skip(f"no C kernel on this machine: {cpu._state.get('error')}")
    return path


def _flipped(blob: bytes) -> bytes:
    mid = len(blob) // 2
    return blob[:mid] + bytes([blob[mid] ^ 0xFF]) + blob[mid + 1 :]


def test_a_corrupt_or_truncated_cached_library_is_rebuilt_never_loaded(real_library, monkeypatch, tmp_path):
    """A truncated shared object crashes the process that dlopens it (SIGBUS): the digest recorded
    at its build is checked first, and a library that does not match it is built again."""
    real = real_library
    cases = {
        "garbage": (b"garbage, not an ELF file", True),
        "truncated": (real.read_bytes()[:1000], True),  # dlopen of this one is a bus error
        "bit flip": (_flipped(real.read_bytes()), True),
        "no digest": (real.read_bytes(), False),  # a build cut short between its two renames
    }
    for i, (damage, with_digest) in enumerate(cases.values()):
        # a root each: the dynamic loader reuses a library already loaded from the same path
        folder = tmp_path / f"root{i}" / "kernels"
        monkeypatch.setenv("ATTNRES_CACHE", str(folder.parent))
        monkeypatch.setattr(cpu, "_state", {})
        folder.mkdir(parents=True, mode=0o700)
        cc = cpu._compiler()
        path = folder / cpu._library_name(cc, True, os.environ.get("ATTNRES_NO_OPENMP", "") in ("", "0"))
        path.write_bytes(damage)
        if with_digest:
            cpu._digest_path(path).write_text(cpu._sha256(real))
        builds = []

        def rebuild(cc, out, native, openmp, builds=builds):  # the build is the real one, copied
            builds.append(out)
            shutil.copy(real, out)
            cpu._digest_path(out).write_text(cpu._sha256(out))

        monkeypatch.setattr(cpu, "_compile", rebuild)
        assert cpu.unavailable_reason() is None, cpu._state.get("error")
        assert builds == [path] and cpu.library_path() == path and path.read_bytes() == real.read_bytes()
        assert cpu.vector_bytes() in (32, 64)  # the rebuilt library runs
