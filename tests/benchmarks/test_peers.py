"""benchmarks/peers.py: finding TCMalloc and the vLLM venv's libiomp5 for LD_PRELOAD, on temp dirs, and
checking them with the real dynamic loader."""
from __future__ import annotations

import ctypes.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import peers  # noqa: E402

# the smallest ELF header ld.so's first check reads: magic, 64-bit, little-endian, e_type at byte 16
ELF_SHARED = b"\x7fELF\x02\x01\x01" + b"\0" * 9 + (3).to_bytes(2, "little") + b"\0" * 46
ELF_EXECUTABLE = b"\x7fELF\x02\x01\x01" + b"\0" * 9 + (2).to_bytes(2, "little") + b"\0" * 46


def _lib(path: Path, content: bytes = ELF_SHARED) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def test_only_elf_shared_objects_count_as_preloadable(tmp_path):
    assert peers.is_shared_object(_lib(tmp_path / "a.so"))
    assert not peers.is_shared_object(_lib(tmp_path / "b.so", ELF_EXECUTABLE))
    assert not peers.is_shared_object(_lib(tmp_path / "c.so", b"INPUT(-ltcmalloc)\n"))  # a linker script
    assert not peers.is_shared_object(tmp_path / "missing.so")


def test_tcmalloc_minimal_is_preferred_in_any_directory_over_the_full_library(tmp_path):
    first, second = tmp_path / "usr-lib", tmp_path / "usr-local-lib"
    _lib(first / "libtcmalloc.so.4")
    _lib(second / "libtcmalloc_minimal.so.4")
    assert peers.find_tcmalloc([first, second]) == second / "libtcmalloc_minimal.so.4"
    (second / "libtcmalloc_minimal.so.4").unlink()
    assert peers.find_tcmalloc([first, second]) == first / "libtcmalloc.so.4"


def test_a_tcmalloc_symlink_to_a_shared_object_is_found_and_a_dangling_one_is_not(tmp_path):
    real = _lib(tmp_path / "lib" / "libtcmalloc_minimal.so.4.5.9")
    (tmp_path / "lib" / "libtcmalloc_minimal.so.4").symlink_to(real.name)
    assert peers.find_tcmalloc([tmp_path / "lib"]) == tmp_path / "lib" / "libtcmalloc_minimal.so.4"
    real.unlink()
    assert peers.find_tcmalloc([tmp_path / "lib"]) is None


def test_iomp5_is_found_in_the_venvs_lib_first_then_under_site_packages(tmp_path):
    venv = tmp_path / "venv"
    nested = _lib(venv / "lib" / "python3.11" / "site-packages" / "intel_openmp" / "libiomp5.so")
    assert peers.find_iomp5(venv) == nested
    direct = _lib(venv / "lib" / "libiomp5.so")
    assert peers.find_iomp5(venv) == direct
    assert peers.find_iomp5(tmp_path / "empty-venv") is None


def test_the_plan_names_each_missing_library_and_quotes_the_set_ups_note(tmp_path):
    venv, libdir = tmp_path / "venv", tmp_path / "lib"
    libdir.mkdir()
    record = peers.preload_plan(venv, [libdir])
    assert record["libs"] == {"tcmalloc": None, "iomp5": None}
    assert "libtcmalloc_minimal.so.4" in record["why_not"]["tcmalloc"] and str(libdir) in record["why_not"]["tcmalloc"]
    assert "make bench-setup" in record["why_not"]["tcmalloc"] and "libiomp5.so" in record["why_not"]["iomp5"]
    venv.mkdir()
    (venv / peers.TCMALLOC_SETUP_NOTE).write_text("`apt-get install libtcmalloc-minimal4` failed (exit 100)\n")
    _lib(venv / "lib" / "libiomp5.so")
    record = peers.preload_plan(venv, [libdir])
    assert "set-up said: `apt-get install libtcmalloc-minimal4` failed (exit 100)" in record["why_not"]["tcmalloc"]
    assert record["libs"]["iomp5"] == str(venv / "lib" / "libiomp5.so") and "iomp5" not in record["why_not"]


def test_mapped_reads_the_real_path_the_kernel_writes_in_proc_maps(tmp_path):
    real = _lib(tmp_path / "libtcmalloc_minimal.so.4.5.9")
    link = tmp_path / "libtcmalloc_minimal.so.4"
    link.symlink_to(real.name)
    maps = (f"7f00-7f10 r-xp 00000000 fd:01 42   {real}\n"
            "7f20-7f30 r--p 00000000 00:00 0 \n"
            "7f40-7f50 rw-p 00000000 00:00 0   [heap]\n")
    assert peers.mapped(maps, [link, tmp_path / "libiomp5.so"]) == {str(link): True, str(tmp_path / "libiomp5.so"): False}


def test_check_keeps_a_library_the_loader_maps_and_drops_one_it_cannot_preload(tmp_path):
    libm = ctypes.util.find_library("m")
    real = next((p for d in peers.SYSTEM_LIB_DIRS if (p := d / (libm or "")).is_file() and libm), None)
    if real is None:
        pytest.skip("no libm shared object in the system library directories")
    fake = _lib(tmp_path / "libiomp5.so")  # an ELF header and nothing else: ld.so refuses it
    record = peers.preload_check(Path(sys.executable), {"libs": {"tcmalloc": str(real), "iomp5": str(fake)}, "why_not": {}})
    assert record["ld_preload"] == str(real)
    assert record["checked"] == {str(real): True, str(fake): False}
    assert "was not mapped with LD_PRELOAD set" in record["why_not"]["iomp5"] and "tcmalloc" not in record["why_not"]


def test_mapped_in_reads_this_process_and_leaves_out_a_process_that_is_gone():
    libc = next(line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                if "libc" in line.split()[-1] and line.split()[-1].startswith("/"))
    seen = peers.mapped_in(["self", 2**22 + 12345], [Path(libc)])
    assert seen == {"self": {libc: True}}
