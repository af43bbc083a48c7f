"""`verify.unsloth_release`: the loader of Unsloth 2026.10.9's NF4 kernel files, run as a peer (AGPL-3.0).

Three groups:
- no release needed (always run, CI too): the error for a missing folder, hash checks on a release
  and a wheel built in tmp_path, the `unsloth_zoo.utils.Version` stand-in and when it is used;
- the extracted release needed: loading, provenance, a modified copy refused, and on a CPU the
  release's own Triton kernel in Triton's interpreter against bitsandbytes' CPU dequantize_4bit,
  bit for bit. These skip when `<repo>/.peers/unsloth-2026.10.9` (or $NF4_UNSLOTH_DIR) is absent,
  as in CI, which never fetches Unsloth. To run them, fetch it first:
      python3 -m pip download --no-deps -d /tmp/peers unsloth==2026.10.9
      python -m verify.unsloth_release extract /tmp/peers/unsloth-2026.10.9-py3-none-any.whl
- GPU (`gpu` marker, skipped without CUDA): fast_dequantize on CUDA, each path (allocate, `out=`,
  use_global_buffer with its kept launch), against bitsandbytes' CUDA dequantize_4bit, and fast_gemv.

In the interpreter the release's `dequantize_nf4` asks torch.cuda for the current device and the
compute capability (for its launch configuration); the CPU tests answer those two questions with
monkeypatch (`current_device` -> None, the release's own `_CONFIG_OVERRIDE` test hook), so its
function and kernel run unchanged. The interpreter converts float32 to bfloat16 by truncation, not
to nearest even, so bf16 outputs are checked on the GPU; on a CPU a test shows that the truncation
is the only difference.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import types
import zipfile

import pytest
import torch

from verify import unsloth_release as ur
from verify.exact import assert_bitexact

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Launch configurations of the release's `_CONFIG_OVERRIDE` hook: (target bytes per program, num_warps,
# int32 words, evict_first, LUT mode), together reaching every branch of its kernel.
CONFIGS = {"bytes-lut0": (256, 2, False, False, 0), "words-lut1": (256, 2, True, True, 1),
           "words-lut2": (512, 4, True, False, 2), "bytes-lut2": (64, 1, False, False, 2)}
SHAPES = [(33, 70), (7, 194), (1, 130), (5, 256)]
INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


# --- helpers --------------------------------------------------------------------------------


def _urlsafe(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _fake_wheel(path, files: dict[str, bytes], record_override: dict[str, bytes] | None = None):
    """A wheel (zip) holding `files` and a RECORD; record_override gives other bytes to hash in RECORD."""
    record = {**files, **(record_override or {})}
    lines = [f"{name},sha256={_urlsafe(data)},{len(data)}" for name, data in record.items()]
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr("fake-0.dist-info/RECORD", "\n".join([*lines, "fake-0.dist-info/RECORD,,"]) + "\n")
    return path


FAKE = {"unsloth/kernels/a.py": b"A = 1\n", "unsloth/kernels/b.py": b"B = 2\n"}
FAKE_EXPECTED = {name: hashlib.sha256(data).hexdigest() for name, data in FAKE.items()}


def _fake_release(tmp_path):
    wheel = _fake_wheel(tmp_path / "fake.whl", FAKE)
    return ur.extract(wheel, tmp_path / "release", expected=FAKE_EXPECTED, wheel_sha256=None, licenses=())


def _flip_byte(path, index=10):
    data = bytearray(path.read_bytes())
    data[index] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def release():
    """The loaded release; skips (not fails) when it was never fetched, as in CI."""
    try:
        ur.verify_release()
    except FileNotFoundError as error:
        pytest.skip(f"Unsloth {ur.VERSION} not extracted: {str(error).splitlines()[0]}")
    return ur.load()


def _quantize(shape, dtype, blocksize, double_quant, seed, device="cpu"):
    import bitsandbytes.functional as F

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-3, 4, shape, generator=g).float())
    x.view(-1)[::11] = 0.0
    return F.quantize_4bit(x.to(dtype).to(device), blocksize=blocksize, compress_statistics=double_quant,
                           quant_type="nf4")


def _bnb(packed, state):
    import bitsandbytes.functional as F

    return F.dequantize_4bit(packed, state, quant_type="nf4")


def _assert_same(got, expect, name="output"):
    assert got.dtype == expect.dtype and tuple(got.shape) == tuple(expect.shape), (got.dtype, got.shape, expect.shape)
    view = INT_VIEW[got.dtype]
    assert torch.equal(got.contiguous().view(view), expect.contiguous().view(view)), name
    assert_bitexact(got, expect, name=name)  # the same check, with a report of the first differences


@pytest.fixture
def interpreter(release, monkeypatch):
    """The CPU stand-ins for the release's two CUDA queries (see the module docstring)."""
    if not INTERPRETING:
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py without CUDA)")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)

    def configure(config):
        monkeypatch.setattr(release.nf4, "_CONFIG_OVERRIDE", config)

    return configure


# --- without the release --------------------------------------------------------------------------


def test_missing_folder_says_how_to_fetch(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere"
    for call in (lambda: ur.load(missing), lambda: ur.provenance(missing)):
        with pytest.raises(FileNotFoundError) as info:
            call()
        message = str(info.value)
        assert str(missing) in message
        assert ur.PIP_DOWNLOAD in message and "pip download --no-deps" in message
        assert ur.EXTRACT in message
    monkeypatch.setenv(ur.ENV, str(missing))
    assert ur.release_root() == missing.resolve()
    with pytest.raises(FileNotFoundError, match="nowhere"):
        ur.load()
    (missing).mkdir()
    with pytest.raises(FileNotFoundError, match=ur.MANIFEST):
        ur.load()


def test_default_root_is_in_the_ignored_peers_folder(monkeypatch):
    monkeypatch.delenv(ur.ENV, raising=False)
    assert ur.release_root() == ur.REPO / ".peers" / "unsloth-2026.10.9"
    assert ur.release_root("elsewhere") == (ur.Path.cwd() / "elsewhere").resolve()


def test_extract_writes_files_and_manifest(tmp_path):
    root = _fake_release(tmp_path)
    manifest = json.loads((root / ur.MANIFEST).read_text())
    assert manifest["version"] == ur.VERSION and manifest["wheel"] == "fake.whl"
    assert manifest["wheel_sha256"] == hashlib.sha256((tmp_path / "fake.whl").read_bytes()).hexdigest()
    assert manifest["files"] == FAKE_EXPECTED
    for name, data in FAKE.items():
        assert (root / name).read_bytes() == data  # the wheel's layout
    assert ur.verify_release(root, expected=FAKE_EXPECTED, wheel_sha256=None) == manifest


def test_extract_refuses_a_bad_wheel(tmp_path):
    good = _fake_wheel(tmp_path / "good.whl", FAKE)
    with pytest.raises(ur.IntegrityError, match="pinned"):  # not the pinned unsloth wheel
        ur.extract(good, tmp_path / "r1", expected=FAKE_EXPECTED, licenses=())
    bad_record = _fake_wheel(tmp_path / "bad.whl", FAKE, record_override={"unsloth/kernels/a.py": b"other\n"})
    with pytest.raises(ur.IntegrityError, match="RECORD"):
        ur.extract(bad_record, tmp_path / "r2", expected=FAKE_EXPECTED, wheel_sha256=None, licenses=())
    other = {**FAKE_EXPECTED, "unsloth/kernels/b.py": "0" * 64}
    with pytest.raises(ur.IntegrityError, match="pinned"):
        ur.extract(good, tmp_path / "r3", expected=other, wheel_sha256=None, licenses=())


def test_hash_check_rejects_a_modified_file(tmp_path):
    root = _fake_release(tmp_path)
    _flip_byte(root / "unsloth/kernels/b.py", 2)
    with pytest.raises(ur.IntegrityError, match=r"b\.py"):
        ur.verify_release(root, expected=FAKE_EXPECTED, wheel_sha256=None)


def test_hash_check_rejects_a_manifest_edited_to_match(tmp_path):
    root = _fake_release(tmp_path)
    target = root / "unsloth/kernels/a.py"
    _flip_byte(target, 0)
    manifest = json.loads((root / ur.MANIFEST).read_text())
    manifest["files"]["unsloth/kernels/a.py"] = hashlib.sha256(target.read_bytes()).hexdigest()
    (root / ur.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ur.IntegrityError, match="pinned"):  # the pinned hashes still disagree
        ur.verify_release(root, expected=FAKE_EXPECTED, wheel_sha256=None)


def test_hash_check_rejects_wrong_version_wheel_and_file_list(tmp_path):
    root = _fake_release(tmp_path)
    path = root / ur.MANIFEST
    good = json.loads(path.read_text())
    for change, match in (({"version": "2026.1.1"}, "version"), ({"wheel_sha256": "0" * 64}, "wheel_sha256"),
                          ({"files": {**good["files"], "x.py": "0" * 64}}, "files")):
        path.write_text(json.dumps({**good, **change}))
        with pytest.raises(ur.IntegrityError, match=match):
            ur.verify_release(root, expected=FAKE_EXPECTED, wheel_sha256=good["wheel_sha256"])
    path.write_text("{not json")
    with pytest.raises(ur.IntegrityError, match="JSON"):
        ur.verify_release(root, expected=FAKE_EXPECTED, wheel_sha256=None)
    path.write_text(json.dumps(good))
    (root / "unsloth/kernels/a.py").unlink()
    with pytest.raises(FileNotFoundError, match=r"a\.py"):
        ur.verify_release(root, expected=FAKE_EXPECTED, wheel_sha256=None)


def test_shim_version_compares_like_unsloth_zoo():
    V = ur.ShimVersion
    assert V("3.7.0") >= V("3.7.0") and V("3.7") == V("3.7.0") and V("3.6.0") < V("3.7.0")
    assert V("3.10.1") > V("3.9.0")  # numerically, not as text
    assert V("3.7.0+git4f2c") > V("3.7.0") and V("3.7.0.dev20260101") > V("3.7.0")  # a suffix is one step above
    assert V("3.7.0rc1") < V("3.7.1")
    assert V(V("3.6.0")) == "3.6.0"
    with pytest.raises(ValueError):
        V("no digits")


def test_shim_only_when_unsloth_zoo_is_missing(monkeypatch):
    real_zoo = importlib.util.find_spec("unsloth_zoo") is not None
    monkeypatch.delitem(sys.modules, "unsloth_zoo.utils", raising=False)
    assert ur.version_shim_needed() is (not real_zoo)
    before = {name: sys.modules.get(name) for name in ("unsloth_zoo", "unsloth_zoo.utils")}
    with ur._version_provider() as shim:
        assert shim is (not real_zoo)
        if shim:
            from unsloth_zoo.utils import Version

            assert Version is ur.ShimVersion
    assert {name: sys.modules.get(name) for name in before} == before  # the stand-in is gone again

    # An unsloth_zoo.utils already imported (the real one, say) is used as it is, untouched.
    zoo_utils = types.ModuleType("unsloth_zoo.utils")
    zoo_utils.Version = object()
    monkeypatch.setitem(sys.modules, "unsloth_zoo.utils", zoo_utils)
    assert not ur.version_shim_needed()
    with ur._version_provider() as shim:
        assert shim is False
        assert sys.modules["unsloth_zoo.utils"] is zoo_utils
    assert sys.modules["unsloth_zoo.utils"] is zoo_utils


# --- with the extracted release ----------------------------------------------------------------------


def test_load_and_provenance(release):
    assert release.version == "2026.10.9"
    assert release.wheel == ur.WHEEL
    assert release.wheel_sha256 == ur.WHEEL_SHA256
    assert release.files == ur.FILES
    prov = release.provenance()
    assert prov == ur.provenance() == {"peer": "unsloth", "version": "2026.10.9",
                                       "wheel_sha256": ur.WHEEL_SHA256, "files": ur.FILES}
    assert set(prov["files"]) == {"unsloth/kernels/nf4.py", "unsloth/kernels/nf4_gemv.py",
                                  "unsloth/kernels/triton_launch.py"}
    assert ur.load() is release  # once per process
    assert release.shim is (importlib.util.find_spec("unsloth_zoo") is None)


def test_loaded_as_a_private_package_without_unsloth(release):
    assert "unsloth" not in sys.modules  # the full package is never imported
    for stem in ("nf4", "nf4_gemv", "triton_launch"):
        module = sys.modules[f"{ur.PACKAGE}.kernels.{stem}"]
        assert module is release.modules[stem]
        assert module.__file__ == str(release.root / "unsloth" / "kernels" / f"{stem}.py")
    assert release.dequantize_nf4 is release.nf4.dequantize_nf4
    assert release.gemv_nf4 is release.nf4_gemv.gemv_nf4
    assert release.nf4.Version is (ur.ShimVersion if release.shim else sys.modules["unsloth_zoo.utils"].Version)
    if release.shim:
        assert "unsloth_zoo" not in sys.modules and "unsloth_zoo.utils" not in sys.modules
    assert not (release.root / "unsloth" / "kernels" / "__pycache__").exists()  # no bytecode written there


def test_modified_copy_is_refused(release, tmp_path):
    copy_root = tmp_path / "unsloth-copy"
    shutil.copytree(release.root, copy_root)
    assert ur.provenance(copy_root) == release.provenance()
    _flip_byte(copy_root / "unsloth/kernels/nf4.py", 500)
    with pytest.raises(ur.IntegrityError, match=r"nf4\.py"):
        ur.verify_release(copy_root)
    with pytest.raises(ur.IntegrityError, match=r"nf4\.py"):
        ur.load(copy_root)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "flat"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_interpreter_exact_with_bnb_cpu(release, interpreter, dtype, double_quant, config):
    """The release's dequantize_nf4 (through fast_dequantize) in the interpreter, bit for bit."""
    interpreter(CONFIGS[config])
    for i, shape in enumerate(SHAPES):
        for blocksize in (64, 128, 256):
            packed, state = _quantize(shape, dtype, blocksize, double_quant, seed=1000 * i + blocksize)
            expect = _bnb(packed, state)
            _assert_same(release.fast_dequantize(packed, state), expect, f"{shape} bs{blocksize}")
            out = torch.empty(state.shape, dtype=dtype)
            got = release.fast_dequantize(packed, state, out=out)
            assert got.data_ptr() == out.data_ptr()
            _assert_same(got, expect, f"{shape} bs{blocksize} out=")


def test_interpreter_bf16_is_truncated_fp32(release, interpreter):
    """bf16 in the interpreter: the kernel's float32 values are bitsandbytes' own, and its bf16 output is
    their truncation (the interpreter's conversion), where bitsandbytes rounds them to nearest even."""
    interpreter(CONFIGS["bytes-lut0"])
    packed, state = _quantize((33, 70), torch.bfloat16, 64, True, seed=7)
    state32 = copy.copy(state)
    state32.dtype = torch.float32
    values = release.fast_dequantize(packed, state32)
    _assert_same(values, _bnb(packed, state32), "fp32 values")
    got = release.fast_dequantize(packed, state)
    assert torch.equal(got.view(torch.int16), (values.view(torch.int32) >> 16).to(torch.int16))
    _assert_same(values.to(torch.bfloat16), _bnb(packed, state), "fp32 values rounded to bf16")


def test_interpreter_refuses_what_unsloth_refuses(release, interpreter):
    interpreter(CONFIGS["bytes-lut0"])
    packed, state = _quantize((4, 64), torch.float16, 64, True, seed=3)
    wrong = torch.empty(4, 64, dtype=torch.float32)
    with pytest.raises(AssertionError):  # utils.py asserts the shape and dtype of `out` first
        release.fast_dequantize(packed, state, out=wrong)
    args = ur._unpack(state)
    absmax, shape, dtype, blocksize, code, code2, absmax2, offset, blocksize2 = args
    with pytest.raises(ValueError, match="wrong dtype or size"):  # and dequantize_nf4 checks them too
        release.dequantize_nf4(packed, absmax, code2, absmax2, offset, code, blocksize, blocksize2, shape, dtype,
                               out=wrong)
    with pytest.raises(ValueError, match="power-of-two"):
        release.dequantize_nf4(packed, absmax, code2, absmax2, offset, code, 96, blocksize2, shape, dtype)
    assert release.fast_dequantize(packed, None) is packed
    fp4 = copy.copy(state)
    fp4.quant_type = "fp4"
    with pytest.raises(ValueError, match="not NF4"):
        release.fast_dequantize(packed, fp4)


# --- GPU -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "flat"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("mode", ["alloc", "out", "global"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_exact_with_bnb(release, dtype, double_quant, mode):
    shapes = [*SHAPES, (4096, 4096 + 64), (11008, 4096)]
    for i, shape in enumerate(shapes):
        for blocksize in (64, 128, 256):
            packed, state = _quantize(shape, dtype, blocksize, double_quant, seed=1000 * i + blocksize, device="cuda")
            expect = _bnb(packed, state)
            name = f"{shape} bs{blocksize} {mode}"
            if mode == "alloc":
                _assert_same(release.fast_dequantize(packed, state), expect, name)
            elif mode == "out":
                out = torch.empty(state.shape, dtype=dtype, device="cuda")
                got = release.fast_dequantize(packed, state, out=out)
                assert got.data_ptr() == out.data_ptr()
                _assert_same(got, expect, name)
            else:
                for repeat in range(3):  # the first call launches and keeps the launch; later ones repeat it
                    got = release.fast_dequantize(packed, state, use_global_buffer=True)
                    _assert_same(got, expect, f"{name} call {repeat}")
                    assert release._dequant_plans.get(state) is not None  # the kept launch is in use
                assert got.data_ptr() == release._scratch_buffers[packed.device.index].data_ptr()
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_global_buffer_is_shared_and_plans_follow_the_buffer(release):
    a_packed, a_state = _quantize((256, 512), torch.float16, 64, True, seed=1, device="cuda")
    b_packed, b_state = _quantize((1024, 1024), torch.float16, 64, True, seed=2, device="cuda")
    a = release.fast_dequantize(a_packed, a_state, use_global_buffer=True).clone()
    _assert_same(a, _bnb(a_packed, a_state), "a")
    b = release.fast_dequantize(b_packed, b_state, use_global_buffer=True)  # grows the buffer
    _assert_same(b, _bnb(b_packed, b_state), "b")
    again = release.fast_dequantize(a_packed, a_state, use_global_buffer=True)  # a's kept launch, new buffer
    _assert_same(again, a, "a after the buffer grew")
    assert again.data_ptr() == b.data_ptr()  # one shared buffer: b was overwritten
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # not the default stream: a fresh output, as Unsloth does
        c = release.fast_dequantize(a_packed, a_state, use_global_buffer=True)
    side.synchronize()
    assert c.data_ptr() != again.data_ptr()
    _assert_same(c, a, "a on a side stream")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", [(4096, 4096), (11008, 4096), (333, 1024), (512, 1000)], ids=str)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_gemv_close(release, dtype, shape):
    """fast_gemv: close to X @ W.T (not bit-exact: its fp32 accumulation order, by Unsloth's account)."""
    packed, state = _quantize(shape, dtype, 64, True, seed=5, device="cuda")
    weight = _bnb(packed, state)
    g = torch.Generator(device="cuda").manual_seed(9)
    for _ in range(3):  # launch, then the kept launch
        X = torch.randn((1, 1, shape[1]), generator=g, device="cuda").to(dtype)
        got = release.fast_gemv(X, packed, state)
        assert (release._gemv_plans.get(state) is not None) == (shape[1] % 64 == 0)  # the kept launch
        expect = (X.float() @ weight.float().t()).to(dtype)
        assert got.shape == (1, 1, shape[0]) and got.dtype == dtype
        scale = expect.float().abs().max().item()
        torch.testing.assert_close(got.float(), expect.float(), rtol=2e-2, atol=2e-2 * scale)
