"""nf4.linear's autotuning on first use (nf4/linear/autotune.py).

On a CPU the race is replaced by a stub that returns chosen times (a GPU name stands in for the device's), so the
choice, its file, the switches and the cases without a race are tested without a GPU. On a CUDA GPU the race runs:
the choice is one of the candidates, the call that made it is operand-exact, and a compiled call runs the same
config (eager's bits).
"""

from __future__ import annotations

import json

import pytest
import torch

import nf4
from nf4 import runtime
from nf4.linear import autotune
from nf4.linear.tuned import CONFIGS, NAMES, tuned

H100 = "NVIDIA H100 80GB HBM3"
SHAPE = (4096, 4096)


class Stub(list):
    """A race that appends each raced key and returns `times`."""

    times: dict[str, float]

    def __call__(self, device, key, configs):
        self.append(key)
        assert configs == autotune.candidates(key.m, configs[0])
        return dict(self.times)


class Capture:
    """A capture check that says what `on` says."""

    on = False

    def __call__(self) -> bool:
        return self.on


@pytest.fixture
def env(monkeypatch, tmp_path):
    """Autotuning on, its file in a fresh folder."""
    monkeypatch.setenv(autotune.ENV, "1")
    monkeypatch.setenv(autotune.CACHE_ENV, str(tmp_path))
    return tmp_path


@pytest.fixture
def tune(env):
    """A tuner with a stub race (`tune.race`), a stub GPU name and a capture switch (`tune.capturing.on`)."""
    return autotune.Tuner(race=Stub(), device_name=lambda device: "" if device.type == "cpu" else H100,
                          capturing=Capture(), fingerprint="f" * 16)


def _pick(tuner, m=1, trans=False, shape=SHAPE, dtype=torch.bfloat16, blocksize=64, nested=True, w_dtype=None):
    return tuner.pick(torch.device("cuda", 0), m, trans, *shape, blocksize, nested, w_dtype or dtype, dtype)


def _times(**named):
    """Every candidate at M = 1 at 10 us unless named."""
    table = tuned(H100, 1, n=SHAPE[0], k=SHAPE[1])
    return {NAMES[c]: named.get(NAMES[c], 10.0) for c in autotune.candidates(1, table)}


def test_candidates_lead_with_the_table_and_stop_past_the_last_row():
    for m in (1, 3, 8, 16, 17, 32, 64, 65, 128, 256, 512):
        table = tuned(H100, m, n=4096, k=4096)
        cands = autotune.candidates(m, table)
        assert cands[0] is table and len(set(cands)) == len(cands) >= 2
        assert all(c in NAMES for c in cands)
    assert autotune.candidates(autotune.MAX_M + 1, CONFIGS["DEQUANT"]) == ()
    assert {NAMES[c] for c in autotune.candidates(1, CONFIGS["GEMV_MMA_WK"])} >= {
        "GEMV_MMA_WK", "GEMV_MMA_WK16", "GEMV_MMA_WK4", "GEMV_MMA_WK2", "GEMV_MMA16"}


def test_the_fastest_is_chosen_kept_on_disk_and_read_back(tune, env):
    tune.race.times = _times(GEMV_MMA_WK4=7.0, GEMV_MMA16=8.0)
    assert _pick(tune) is CONFIGS["GEMV_MMA_WK4"]
    assert _pick(tune) is CONFIGS["GEMV_MMA_WK4"] and len(tune.race) == 1  # in memory: no second race
    entries = json.loads((env / autotune.FILE).read_text())["entries"]
    (text, entry), = entries.items()
    assert entry["config"] == "GEMV_MMA_WK4" and entry["us"]["GEMV_MMA_WK4"] == 7.0
    assert text == f"{H100}|{'f' * 16}|4096|4096|64|1|bfloat16|bfloat16|1"
    tune.forget()
    tune.race.times = _times(GEMV_MMA16=1.0)  # a race now would pick another: the file answers first
    assert _pick(tune) is CONFIGS["GEMV_MMA_WK4"] and len(tune.race) == 1
    other = autotune.Tuner(race=Stub(), device_name=tune.device_name, capturing=Capture(), fingerprint="f" * 16)
    assert _pick(other) is CONFIGS["GEMV_MMA_WK4"] and not other.race  # another process reads it too


def test_each_key_field_is_its_own_choice(tune):
    tune.race.times = _times(GEMV_MMA_WK4=7.0)
    _pick(tune)
    _pick(tune, nested=False)
    _pick(tune, blocksize=128)
    _pick(tune, w_dtype=torch.float16)
    _pick(tune, dtype=torch.float16)
    _pick(tune, m=2)
    _pick(tune, shape=(4096, 8192))
    assert len(tune.race) == 7 and len(set(tune.race)) == 7


def test_each_power_of_two_bucket_of_m_races_once_at_its_top(tune):
    assert [autotune.bucket(m) for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 100, 129, 300, 512)] == [
        1, 2, 4, 4, 8, 8, 16, 16, 32, 64, 128, 256, 512, 512]
    tune.race.times = _times(GEMV_MMA_WK4=7.0)
    _pick(tune, m=3)
    _pick(tune, m=4)
    assert [key.m for key in tune.race] == [4]
    tune.race.times = {NAMES[c]: 10.0 - i for i, c in enumerate(autotune.candidates(
        300, tuned(H100, 512, n=SHAPE[0], k=SHAPE[1])))}
    for m in (300, 257, 512):
        _pick(tune, m=m)
    assert [key.m for key in tune.race] == [4, 512]
    for gpu in (H100, "NVIDIA H200"):  # the table's rows and rules split M where the buckets do
        for n, k in (SHAPE, (14336, 4096), (512, 896), (28672, 3584), (1536, 8960), (152064, 3584)):
            for m in range(1, autotune.MAX_M + 1):
                assert tuned(gpu, m, n=n, k=k) is tuned(gpu, autotune.bucket(m), n=n, k=k), (gpu, n, k, m)


def test_a_near_tie_keeps_the_table(tune):
    table = tuned(H100, 1, n=SHAPE[0], k=SHAPE[1])
    tune.race.times = _times(**{NAMES[table]: 10.0, "GEMV_MMA_WK4": 10.0 * (1 - autotune.TIE / 2)})
    assert _pick(tune) is table
    tune.forget()
    (tune.race.times)["GEMV_MMA_WK4"] = 10.0 * (1 - 2 * autotune.TIE)
    assert _pick(tune) is table  # kept: the file answers
    fresh = autotune.Tuner(race=tune.race, device_name=tune.device_name, capturing=Capture(), fingerprint="g" * 16)
    assert _pick(fresh) is CONFIGS["GEMV_MMA_WK4"]


def test_switched_off_it_races_nothing(tune, monkeypatch):
    monkeypatch.setenv(autotune.ENV, "0")
    tune.race.times = _times(GEMV_MMA_WK4=1.0)
    assert _pick(tune) is tuned(H100, 1, n=SHAPE[0], k=SHAPE[1]) and not tune.race


@pytest.mark.parametrize("value", ["false", "off", "2", "yes"])
def test_a_switch_value_other_than_0_or_1_is_refused(tune, monkeypatch, value):
    monkeypatch.setenv(autotune.ENV, value)
    with pytest.raises(ValueError, match=f"NF4_AUTOTUNE must be 0 .* or 1 .*got '{value}'"):
        _pick(tune)
    assert not tune.race


@pytest.mark.parametrize("value", ["", " 1 "])
def test_an_empty_switch_or_1_races(tune, monkeypatch, value):
    monkeypatch.setenv(autotune.ENV, value)
    tune.race.times = _times(GEMV_MMA_WK4=1.0)
    assert _pick(tune) is CONFIGS["GEMV_MMA_WK4"]


def test_no_race_for_the_backward_past_the_last_row_or_in_the_interpreter(tune):
    tune.race.times = {"DEQUANT": 1.0}
    assert _pick(tune, m=64, trans=True) is tuned(H100, 64, True, n=SHAPE[0], k=SHAPE[1])
    assert _pick(tune, m=autotune.MAX_M + 1) is tuned(H100, autotune.MAX_M + 1, n=SHAPE[0], k=SHAPE[1])
    assert tune.pick(torch.device("cpu"), 1, False, *SHAPE, 64, True, torch.bfloat16, torch.bfloat16) is \
        tuned("", 1)
    assert not tune.race


def test_during_a_capture_the_table_runs_and_nothing_is_remembered(tune):
    tune.capturing.on = True
    tune.race.times = _times(GEMV_MMA_WK4=1.0)
    assert _pick(tune) is tuned(H100, 1, n=SHAPE[0], k=SHAPE[1]) and not tune.race
    tune.capturing.on = False
    assert _pick(tune) is CONFIGS["GEMV_MMA_WK4"] and len(tune.race) == 1


def test_a_choice_made_before_a_capture_serves_it(tune):
    tune.race.times = _times(GEMV_MMA_WK4=1.0)
    _pick(tune)
    tune.capturing.on = True
    assert _pick(tune) is CONFIGS["GEMV_MMA_WK4"]  # from memory
    tune.forget()
    assert _pick(tune) is CONFIGS["GEMV_MMA_WK4"] and len(tune.race) == 1  # from the file


def test_a_failed_race_warns_once_and_runs_the_table(env):
    calls = []

    def broken(device, key, configs):
        calls.append(key)
        raise RuntimeError("out of memory")

    tuner = autotune.Tuner(race=broken, device_name=lambda device: H100, capturing=Capture(), fingerprint="f" * 16)
    with pytest.warns(RuntimeWarning, match=r"autotuning 4096x4096 at M = 1 failed \(RuntimeError: out of memory"):
        assert _pick(tuner) is tuned(H100, 1, n=SHAPE[0], k=SHAPE[1])
    assert _pick(tuner) is tuned(H100, 1, n=SHAPE[0], k=SHAPE[1]) and len(calls) == 1  # remembered: no second race
    assert not (env / autotune.FILE).exists()  # and not kept: another process races


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"entries": 3}', '{"entries": {"x": 1}}'])
def test_an_unreadable_file_is_raced_over_and_rewritten(tune, env, content):
    (env / autotune.FILE).write_text(content)
    tune.race.times = _times(GEMV_MMA_WK4=1.0)
    assert _pick(tune) is CONFIGS["GEMV_MMA_WK4"] and len(tune.race) == 1
    entries = json.loads((env / autotune.FILE).read_text())["entries"]
    assert [e["config"] for e in entries.values() if isinstance(e, dict)] == ["GEMV_MMA_WK4"]


def test_a_kept_name_that_is_not_a_candidate_is_raced_again(tune, env):
    tune.race.times = _times(GEMV_MMA_WK4=1.0)
    _pick(tune)
    path = env / autotune.FILE
    data = json.loads(path.read_text())
    for entry in data["entries"].values():
        entry["config"] = "WORD_GEMM256"  # a config, but not one raced at M = 1
    path.write_text(json.dumps(data))
    tune.forget()
    tune.race.times = _times(GEMV_MMA16=1.0)
    assert _pick(tune) is CONFIGS["GEMV_MMA16"] and len(tune.race) == 2


def test_a_changed_fingerprint_races_again(tune):
    tune.race.times = _times(GEMV_MMA_WK4=1.0)
    _pick(tune)
    changed = autotune.Tuner(race=tune.race, device_name=tune.device_name, capturing=Capture(),
                             fingerprint="another-kernel")
    tune.race.times = _times(GEMV_MMA16=1.0)
    assert _pick(changed) is CONFIGS["GEMV_MMA16"] and len(tune.race) == 2


def test_the_fingerprint_follows_the_sources():
    first = autotune.source_fingerprint()
    assert first == autotune.source_fingerprint() and len(first) == 16
    assert autotune.Tuner().fingerprint == first


def test_an_unwritable_folder_keeps_the_choice_in_memory(tune, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(autotune.CACHE_ENV, str(blocker / "nf4"))
    tune.race.times = _times(GEMV_MMA_WK4=1.0)
    with pytest.warns(RuntimeWarning, match="could not keep autotuned configs"):
        assert _pick(tune) is CONFIGS["GEMV_MMA_WK4"]
    assert _pick(tune) is CONFIGS["GEMV_MMA_WK4"] and len(tune.race) == 1


def test_the_default_folder_is_under_the_home_cache(monkeypatch):
    monkeypatch.delenv(autotune.CACHE_ENV, raising=False)
    monkeypatch.setenv("HOME", "/home/someone")
    assert str(autotune.cache_path()) == "/home/someone/.cache/nf4/linear.json"


@pytest.mark.parametrize("nested", [True, False])
def test_the_synthetic_weight_is_a_weight_nf4_dequantizes(nested):
    """What a race times has bitsandbytes' layout: nf4.dequantize takes it (on a GPU, or in the interpreter)."""
    from nf4.dequant.api import dequantize_weight

    device = "cuda" if torch.cuda.is_available() and not runtime.interpreter_on() else "cpu"
    w = autotune.synthetic_weight(16, 128, 64, nested, torch.bfloat16, device, seed=3)
    assert tuple(w.packed.shape) == (16 * 128 // 2, 1) and w.packed.dtype == torch.uint8
    assert w.absmax.numel() == 32 and (w.absmax2 is not None) == nested
    out = dequantize_weight(w)
    assert out.shape == (16, 128) and out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    again = autotune.synthetic_weight(16, 128, 64, nested, torch.bfloat16, device, seed=3)
    assert torch.equal(w.packed, again.packed) and torch.equal(w.absmax, again.absmax)


# --- on a CUDA GPU: the race itself ---------------------------------------------------------------------------


@pytest.fixture
def gpu_tune(env):
    """Autotuning on with a fresh file and none of the process's choices in memory (before and after)."""
    if not torch.cuda.is_available() or runtime.interpreter_on():
        pytest.skip("needs a CUDA GPU and compiled kernels")
    autotune.TUNER.forget()
    yield env
    autotune.TUNER.forget()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 16, 40, 200])
def test_the_race_picks_a_candidate_and_the_call_is_exact(nf4h, lin, gpu_tune, m):
    """A first call races (the file gains the key, every runnable candidate timed) and its result is the operand
    check's exact one; the chosen config is what `pick` gives afterwards."""
    n, k = 1000, 1536
    dtype = torch.bfloat16
    packed, qs = nf4h.quantize((n, k), dtype, 64, True, seed=nf4h.case_seed("autotune", m), device="cuda")
    cols = lin.columns(k, m, seed=m)
    x, scales = lin.identity_rows(cols, dtype, k, seed=m + 1, device="cuda")
    got = nf4.linear(x, packed, qs)
    lin_expected = lin.picked(lin.operand(packed, qs, dtype).t(), cols, scales, dtype)
    from verify.exact import assert_bitexact

    assert_bitexact(got, lin_expected, name=f"autotuned M={m}")
    entries = json.loads((gpu_tune / autotune.FILE).read_text())["entries"]
    top = autotune.bucket(m)  # the race ran at the top of m's bucket
    (entry,) = (e for t, e in entries.items() if t.endswith(f"|{n}|{k}|64|1|bfloat16|bfloat16|{top}"))
    table = tuned(runtime.device_name(x.device), top, n=n, k=k)
    assert entry["config"] in {NAMES[c] for c in autotune.candidates(top, table)}
    assert NAMES[table] in entry["us"] and len(entry["us"]) >= 2 and all(t > 0 for t in entry["us"].values())
    picked = autotune.pick(x.device, m, False, n, k, 64, True, dtype, dtype)
    assert NAMES[picked] == entry["config"]


@pytest.mark.gpu
def test_compiled_calls_race_while_tracing_and_keep_eagers_bits(nf4h, lin, gpu_tune):
    """torch.compile(fullgraph=True) with no choice made yet: the race runs while the op is traced (outside the
    fake-tensor modes), no graph break, and eager (which then reads the same choice) gives the same bits."""
    from torch._dynamo.utils import counters

    from verify.exact import assert_bitexact

    dtype = torch.float16
    packed, qs = nf4h.quantize((777, 1024), dtype, 64, True, seed=nf4h.case_seed("autotune-compile"), device="cuda")
    x = lin.randn((3, 1024), dtype, 5, device="cuda")

    def fn(x):
        return nf4.linear(x, packed, qs)

    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(fn, fullgraph=True, dynamic=False)(x)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert (gpu_tune / autotune.FILE).exists()
    assert_bitexact(got, fn(x), name="compiled vs eager after the race")
    torch._dynamo.reset()
