"""labkit.fast.kernels (the decode step's norms, RoPE with attention, and SwiGLU in C) against
the torch operations they replace, the decoder that uses them against the model's forward,
and the fallback where they cannot be built."""

import copy
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_lean import _random, assert_decoder_matches_model

from labkit import fast
from labkit.fast import kernels
from labkit.fast.layer import rope


@pytest.fixture(scope="module")
def K():
    """The kernels, built here; a machine with a C compiler must build them."""
    if kernels._compiler() is None:
        pytest.skip("no C compiler on this machine: the decoder runs torch operations")
    built = kernels.load()
    assert built is not None, kernels.reason()
    return built


@pytest.mark.parametrize("n", [128, 13, 3])
def test_rms_rows_is_the_rms_norm(K, n):
    torch.manual_seed(0)
    x = torch.randn(16, n) * 3
    torch.testing.assert_close(K.rms_rows(x, 1e-6), F.rms_norm(x, (n,), None, 1e-6),
                               atol=1e-6, rtol=1e-6)


def test_swiglu_is_silu_of_gate_times_up(K):
    torch.manual_seed(0)
    gate = torch.cat([torch.linspace(-120, 120, 2001), torch.randn(1999)])  # exp's whole range
    up = torch.randn(4000)
    gu = torch.cat([gate.view(2, -1), up.view(2, -1)], dim=1).contiguous()
    want = F.silu(gate) * up
    torch.testing.assert_close(K.swiglu(gu).reshape(-1), want, atol=1e-6, rtol=2e-6)
    nan = torch.tensor([[float("nan"), 1.0, 2.0, 2.0]])
    out = K.swiglu(nan)
    assert torch.isnan(out[0, 0]) and out[0, 1] == F.silu(torch.tensor(1.0)) * 2


def _attention_case(N=6, H=4, Hkv=2, D=16, S=12, col=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(N, (H + 2 * Hkv) * D, generator=g)
    keys = torch.randn(N, Hkv, S, D, generator=g)
    values = torch.randn(N, Hkv, S, D, generator=g)
    bias = torch.zeros(N, S)
    bias[0, :3] = bias[2, :1] = torch.finfo(torch.float32).min  # left padding of two rows
    tables = torch.randn(N, 5, 2, D, generator=g)  # rows apart, as a decoder's step tables
    return qkv, tables[:, 2, 0], tables[:, 2, 1], keys, values, bias, col, (H, Hkv, D)


def _reference(qkv, cos, sin, keys, values, bias, col, dims):
    """rope, then softmax attention over positions 0..col, in torch operations."""
    H, Hkv, D = dims
    N = qkv.shape[0]
    q, k, v = qkv.view(N, H + 2 * Hkv, D).split([H, Hkv, Hkv], dim=1)
    q, k = rope(q, cos[:, None], sin[:, None]), rope(k, cos[:, None], sin[:, None])
    keys, values = keys.clone(), values.clone()
    keys[:, :, col], values[:, :, col] = k, v
    kk = keys[:, :, :col + 1].repeat_interleave(H // Hkv, dim=1)
    vv = values[:, :, :col + 1].repeat_interleave(H // Hkv, dim=1)
    scores = torch.einsum("nhd,nhsd->nhs", q, kk) + bias[:, None, :col + 1]
    out = torch.einsum("nhs,nhsd->nhd", scores.softmax(-1), vv)
    return out.reshape(N, H * D), keys, values


@pytest.mark.parametrize("dims", [(4, 2, 16), (4, 4, 32), (2, 1, 6), (2, 1, 96)])
def test_rope_attend_is_rope_then_attention_and_writes_the_cache(K, dims):
    H, Hkv, D = dims
    qkv, cos, sin, keys, values, bias, col, _ = _attention_case(H=H, Hkv=Hkv, D=D)
    want, want_keys, want_values = _reference(qkv, cos, sin, keys, values, bias, col, dims)
    got = K.rope_attend(qkv, cos, sin, keys, values, bias, col)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(keys, want_keys, atol=1e-6, rtol=1e-6)
    assert torch.equal(values, want_values)


def _shared_case(B=3, G=2, H=4, Hkv=2, D=16, P=5, T=6, t=3, seed=1):
    """A group-shared prompt cache (B, Hkv, P, D) and the rows' own (B*G, Hkv, T, D)."""
    g = torch.Generator().manual_seed(seed)
    qkv, cos, sin, keys, values, _, _, dims = _attention_case(N=B * G, H=H, Hkv=Hkv, D=D, S=T,
                                                               col=t, seed=seed)
    prompt_k, prompt_v = torch.randn(2, B, Hkv, P, D, generator=g)
    prompt_bias = torch.zeros(B, P)
    prompt_bias[1, :2] = torch.finfo(torch.float32).min
    return qkv, cos, sin, keys, values, t, (prompt_k, prompt_v, prompt_bias), dims


@pytest.mark.parametrize("dims", [(4, 2, 16), (2, 2, 8), (2, 1, 6), (2, 1, 96)])
def test_rope_attend_reads_a_groups_shared_prompt_before_each_rows_own_keys(K, dims):
    H, Hkv, D = dims
    qkv, cos, sin, keys, values, t, shared, _ = _shared_case(H=H, Hkv=Hkv, D=D)
    prompt_k, prompt_v, prompt_bias = shared
    N, G = keys.shape[0], keys.shape[0] // prompt_k.shape[0]
    # the same attention over each row's prompt copy then its own keys, in torch operations
    whole_k = torch.cat([prompt_k.repeat_interleave(G, 0), keys], dim=2)
    whole_v = torch.cat([prompt_v.repeat_interleave(G, 0), values], dim=2)
    bias = torch.cat([prompt_bias.repeat_interleave(G, 0), torch.zeros(N, keys.shape[2])], 1)
    P = prompt_k.shape[2]
    want, want_keys, want_values = _reference(qkv, cos, sin, whole_k, whole_v, bias, P + t, dims)
    got = K.rope_attend(qkv, cos, sin, keys, values, None, t, shared)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(keys, want_keys[:, :, P:], atol=1e-6, rtol=1e-6)
    assert torch.equal(values, want_values[:, :, P:])


def test_a_rows_result_does_not_depend_on_the_rows_beside_it(K):
    qkv, cos, sin, keys, values, bias, col, _ = _attention_case(N=9, seed=3)
    every = K.rope_attend(qkv, cos, sin, keys.clone(), values.clone(), bias, col)
    x = torch.randn(9, 40)
    for i in (0, 4, 8):
        one = K.rope_attend(qkv[i:i + 1], cos[i:i + 1], sin[i:i + 1], keys[i:i + 1].clone(),
                            values[i:i + 1].clone(), bias[i:i + 1], col)
        assert torch.equal(one, every[i:i + 1])
        assert torch.equal(K.rms_rows(x[i:i + 1], 1e-5), K.rms_rows(x, 1e-5)[i:i + 1])
        assert torch.equal(K.swiglu(x[i:i + 1]), K.swiglu(x)[i:i + 1])
    qkv, cos, sin, keys, values, t, (pk, pv, pb), _ = _shared_case(B=3, G=2)
    every = K.rope_attend(qkv, cos, sin, keys.clone(), values.clone(), None, t, (pk, pv, pb))
    group = slice(2, 4)  # the second prompt's two rows alone
    alone = K.rope_attend(qkv[group], cos[group], sin[group], keys[group].clone(),
                          values[group].clone(), None, t, (pk[1:2], pv[1:2], pb[1:2]))
    assert torch.equal(alone, every[group])


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_the_attention_on_torchs_threads_gives_the_bits_of_one_thread(K, threads):
    # (group, head) items split unevenly over the threads: 24 and 12 of them
    plain = _attention_case(N=6, seed=4)
    qkv, cos, sin, keys, values, t, shared, _ = _shared_case(B=3, G=2, seed=5)
    held = torch.get_num_threads()
    got = {}
    try:
        for n in (1, threads):
            torch.set_num_threads(n)
            a = K.rope_attend(*plain[:3], plain[3].clone(), plain[4].clone(), *plain[5:7])
            b = K.rope_attend(qkv, cos, sin, keys.clone(), values.clone(), None, t, shared)
            got[n] = (a, b)
    finally:
        torch.set_num_threads(held)
    assert torch.equal(got[1][0], got[threads][0]) and torch.equal(got[1][1], got[threads][1])


def test_the_kernels_find_torchs_openmp_threads_where_torch_runs_on_gnu_openmp(K):
    maps = Path("/proc/self/maps")  # Linux: what the process has loaded
    gomp = maps.exists() and "libgomp" in maps.read_text()
    assert K.threaded == gomp


def test_bad_inputs_name_the_argument_before_any_c_runs(K):
    qkv, cos, sin, keys, values, bias, col, _ = _attention_case()
    with pytest.raises(ValueError, match="x must be a contiguous fp32"):
        K.rms_rows(torch.randn(8, 4).t(), 1e-6)
    with pytest.raises(ValueError, match="gate_up must be a contiguous fp32"):
        K.swiglu(torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="bias"):
        K.rope_attend(qkv, cos, sin, keys, values, bias[:, :5], col)
    with pytest.raises(ValueError, match="col"):
        K.rope_attend(qkv, cos, sin, keys, values, bias, keys.shape[2])
    with pytest.raises(ValueError, match="cos"):
        K.rope_attend(qkv, cos.t().contiguous().t(), sin, keys, values, bias, col)
    qkv, cos, sin, keys, values, t, (pk, pv, pb), _ = _shared_case(B=3, G=2)
    with pytest.raises(ValueError, match="shared keys and values"):
        K.rope_attend(qkv, cos, sin, keys, values, None, t, (pk[:, :1].contiguous(), pv, pb))
    with pytest.raises(ValueError, match="shared bias must be a contiguous"):
        K.rope_attend(qkv, cos, sin, keys, values, None, t, (pk, pv, pb.t()))


@pytest.mark.parametrize("shared_prefix", [False, True])
@pytest.mark.parametrize("kind", ["embedded", "llama-gqa", "qwen2"])
def test_the_decoder_with_kernels_matches_the_model_at_every_step(K, tiny, kind,
                                                                   shared_prefix):
    model, tokenizer = tiny
    model = copy.deepcopy(model).eval() if kind == "embedded" else _random(kind, len(tokenizer))
    with torch.no_grad():
        for p in model.parameters():
            if kind != "embedded" and p.dim() == 2:
                p.normal_(0, 0.15)
    decoder = fast.Decoder(model, torch.float32, shared_prefix=shared_prefix)
    assert decoder.kernels is K
    assert_decoder_matches_model(decoder, model, tokenizer)


def test_the_decoder_uses_kernels_only_where_they_serve(K, tiny, monkeypatch):
    model, _ = tiny
    assert fast.Decoder(model).kernels is K
    assert fast.Decoder(model).kv.by_row is True  # the layout the kernels read
    assert fast.Decoder(model, fused=False).kernels is None
    shared = fast.Decoder(model, shared_prefix=True)
    assert shared.kernels is K and shared.kv.by_row is True  # the prompt's keys by row
    assert fast.Decoder(model, torch.bfloat16, fused=True).kernels is None
    qwen3 = _random("qwen3", model.config.vocab_size)
    assert fast.Decoder(qwen3, fused=True).kernels is None  # q and k norms
    with kernels.off():  # the bench's floor records its step so
        assert fast.Decoder(model, fused=True).kernels is None
    assert not kernels.held_off() and fast.Decoder(model).kernels is K
    monkeypatch.setattr(kernels, "FUSED_MAX_PARAMS", 1000)  # a model above the size rule
    assert fast.Decoder(model).kernels is None
    assert fast.Decoder(model, fused=True).kernels is K
    monkeypatch.setattr(kernels, "load", lambda: None)  # no compiler: torch operations
    decoder = fast.Decoder(model, fused=True)
    assert decoder.kernels is None and decoder.kv.by_row is None


def test_kernels_are_built_once_per_machine_and_reused(tmp_path, monkeypatch):
    if kernels._compiler() is None:
        pytest.skip("no C compiler on this machine")
    monkeypatch.setenv("LABKIT_KERNELS_DIR", str(tmp_path))
    first = kernels.load.__wrapped__()
    assert first is not None, kernels.reason()
    built = list(tmp_path.iterdir())
    assert [p.suffix for p in built] == [".so"]
    stamp = built[0].stat().st_mtime_ns
    again = kernels.load.__wrapped__()
    assert again.path == first.path and built[0].stat().st_mtime_ns == stamp


def test_without_a_compiler_or_when_turned_off_there_are_none_and_a_reason(tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv("LABKIT_KERNELS_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.warns(UserWarning, match="could not run"):
        assert kernels.load.__wrapped__() is None
    assert "no-such-cc" in kernels.reason() and not list(tmp_path.glob("*.so"))
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    with pytest.warns(UserWarning, match="failed to build"):
        assert kernels.load.__wrapped__() is None
    assert not list(tmp_path.iterdir())  # no half-built file is left
    monkeypatch.setenv("LABKIT_KERNELS", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.load.__wrapped__() is None
    assert "LABKIT_KERNELS" in kernels.reason()
