"""generation.engine: the decode loop with a slot KV cache and one captured step samples what a plain reference loop
samples (no cache: the whole sequence through the model's own forward each step, the same draws), EOS ends a row
and is kept, weights updated in place are what the next call samples from, the cache takes autocast's dtype, and
the Gumbel-max draw has the model's distribution (chi-square). The CUDA graph tests are marked gpu."""

import math

import pytest
import torch

from liger_patch_kd.generation import Sampling, decode, release_sessions
from liger_patch_kd.generation.engine import CAPTURES, PREFILL_WIDTH_MULTIPLE, session_of, sessions_of, widened
from liger_patch_kd.generation.sampling import draw, filtered_scores

from .tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _model(arch="llama", dtype=torch.float64, seed=0, **config):
    model = tiny_model(arch, dtype=dtype, seed=seed, **config)
    model.set_attn_implementation("sdpa")  # the engine's masks are SDPA's (the tiny models default to eager)
    return model.eval()


def _prompts(device="cpu"):
    ids = torch.randint(40, 200, (5, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = mask[3, :5] = 0  # left padding of different widths
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


def reference(model, ids, mask, max_new_tokens, sampling, pad_id, eos_ids):
    """Sampling without a KV cache: every step runs the whole sequence (the model's own masks and positions from
    the 2D mask) and draws as the engine does; padding after a row's end; stops when every row has ended."""
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=ids.device)
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    tokens, logprobs = [], []
    for _ in range(max_new_tokens):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
        nxt = draw(filtered_scores(logits, sampling), sampling)
        limit = sampling.vocab_limit or logits.shape[-1]
        logprobs.append(logits[:, :limit].float().log_softmax(-1).gather(-1, nxt[:, None])[:, 0])
        if len(eos):
            nxt = torch.where(done, pad_id, nxt)
            done |= torch.isin(nxt, eos)
        tokens.append(nxt)
        ids, mask = torch.cat([ids, nxt[:, None]], 1), torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        if len(eos) and bool(done.all()):
            break
    return torch.stack(tokens, 1), torch.stack(logprobs, 1)


def _gpu_case():
    """The CUDA graph tests' float32 Llama on the GPU and its left-padded prompts."""
    return _model("llama", torch.float32, seed=7).to(DEVICE), *_prompts(DEVICE)


SAMPLINGS = {
    "plain": Sampling(),
    "warped": Sampling(temperature=0.7, top_k=20, top_p=0.9, vocab_limit=250),
    "greedy": Sampling(temperature=0.0),
}


def decodes_as_the_reference(model, sampling: Sampling, **options) -> tuple[torch.Tensor, set[int]]:
    """decode() (eager, 9 new tokens, `options`) on _prompts() against the uncached reference loop with the same
    draws, EOS ids chosen from a free run so that rows 0 and 2 end by columns 2 and 6: the same tokens, log-probs to
    float32 rounding. Returns (tokens, eos ids)."""
    ids, mask = _prompts()
    torch.manual_seed(3)
    free, _ = reference(model, ids, mask, 9, sampling, 0, ())
    eos = {int(free[0, 2]), int(free[2, 6])}
    torch.manual_seed(3)
    want, want_lp = reference(model, ids, mask, 9, sampling, 0, eos)
    torch.manual_seed(3)
    got, got_lp = decode(model, ids, mask, max_new_tokens=9, sampling=sampling, pad_id=0, eos_ids=eos,
                         capture="eager", logprobs=True, **options)  # fmt: skip
    assert torch.equal(got, want)
    torch.testing.assert_close(got_lp, want_lp.float(), rtol=0, atol=1e-5)
    return got, eos


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("name", list(SAMPLINGS))
@pytest.mark.parametrize("check_every", [1, 3])
def test_engine_samples_what_the_uncached_reference_samples(arch, name, check_every):
    model = _model(arch, torch.float64, seed=1)
    got, eos = decodes_as_the_reference(model, SAMPLINGS[name], check_every=check_every)
    ended = [row for row in range(5) if bool(torch.isin(got[row], torch.tensor(sorted(eos))).any())]
    assert ended  # some row ended: its EOS is kept and padding follows
    for row in ended:
        first = int(torch.isin(got[row], torch.tensor(sorted(eos))).nonzero()[0])
        assert (got[row, first + 1 :] == 0).all()
    release_sessions(model)


def test_without_eos_every_row_runs_to_max_new_tokens_and_sessions_are_reused():
    model = _model("llama", torch.float64, seed=2)
    ids, mask = _prompts()
    torch.manual_seed(0)
    first, _ = decode(model, ids, mask, max_new_tokens=6, sampling=Sampling(), pad_id=0)
    assert first.shape == (5, 6)
    key_before = session_of(model).key
    torch.manual_seed(0)
    again, _ = decode(model, ids, mask, max_new_tokens=6, sampling=Sampling(), pad_id=0)
    assert session_of(model).key == key_before  # the same bucket: the same session
    assert torch.equal(first, again)  # a seed gives the same tokens, whatever the session held before
    release_sessions(model)
    assert session_of(model) is None and sessions_of(model) == []


def test_two_buckets_alternate_without_rebuilding_and_a_third_releases_the_oldest():
    """A run's rollouts (sampling) and an evaluation's greedy decode between its steps keep a session each
    (KEEP_SESSIONS = 2): alternating reuses both, the tokens are those of a fresh session; a third bucket releases
    the least recently used; parameters moved to new storage drop the old storage's sessions."""
    model = _model("llama", torch.float64, seed=2)
    ids, mask = _prompts()
    greedy = Sampling(temperature=0.0)
    torch.manual_seed(0)
    sampled, _ = decode(model, ids, mask, max_new_tokens=6, sampling=Sampling(), pad_id=0)
    rollouts = session_of(model)
    evaluation_tokens, _ = decode(model, ids, mask, max_new_tokens=6, sampling=greedy, pad_id=0)
    evaluation = session_of(model)
    assert evaluation is not rollouts and sessions_of(model) == [rollouts, evaluation]
    torch.manual_seed(0)
    again, _ = decode(model, ids, mask, max_new_tokens=6, sampling=Sampling(), pad_id=0)
    assert session_of(model) is rollouts and sessions_of(model) == [evaluation, rollouts]  # reused, now newest
    assert torch.equal(again, sampled)  # what the session left from the other bucket's call changes nothing
    assert torch.equal(decode(model, ids, mask, max_new_tokens=6, sampling=greedy, pad_id=0)[0], evaluation_tokens)
    decode(model, ids[:3], mask[:3], max_new_tokens=6, sampling=greedy, pad_id=0)  # a third bucket: 3 rows
    assert rollouts not in sessions_of(model) and sessions_of(model)[0] is evaluation  # the oldest went
    model.to(torch.float32)  # new storage for every parameter
    decode(model, ids, mask, max_new_tokens=6, sampling=greedy, pad_id=0)
    assert len(sessions_of(model)) == 1 and session_of(model).key.storage[0] == next(model.parameters()).data_ptr()
    release_sessions(model)


def test_weights_updated_in_place_are_what_the_next_call_samples_from():
    model = _model("llama", torch.float64, seed=3)
    ids, mask = _prompts()
    greedy = Sampling(temperature=0.0)
    before, _ = decode(model, ids, mask, max_new_tokens=5, sampling=greedy, pad_id=0)
    with torch.no_grad():  # an optimizer step: the same storage, new values
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    after, _ = decode(model, ids, mask, max_new_tokens=5, sampling=greedy, pad_id=0)
    want, _ = reference(model, ids, mask, 5, greedy, 0, ())
    assert torch.equal(after, want)
    assert not torch.equal(after, before)


def test_the_cache_takes_the_dtype_keys_have_under_autocast(monkeypatch):
    """float32 weights under bfloat16 autocast: the cache is allocated in the dtype the keys arrive in (allocating
    by the weights' dtype gave index_copy_'s Float / BFloat16 error), and a call without autocast gets its own."""
    from liger_patch_kd.generation.kv_cache import SlotCache

    seen = []
    update = SlotCache.update
    monkeypatch.setattr(
        SlotCache, "update", lambda self, k, v, i, *a, **kw: seen.append(k.dtype) or update(self, k, v, i)
    )
    model = _model("llama", torch.float32, seed=4)
    ids, mask = _prompts()
    with torch.autocast("cpu", torch.bfloat16):
        tokens, _ = decode(model, ids, mask, max_new_tokens=4, sampling=Sampling(), pad_id=0)
    session = session_of(model)
    assert tokens.shape == (5, 4) and session.cache.keys[0].dtype == seen[0] and session.key.key_dtype is torch.bfloat16
    decode(model, ids, mask, max_new_tokens=4, sampling=Sampling(), pad_id=0)  # no autocast: a new session
    assert session_of(model).key.key_dtype is None

    cache = SlotCache(num_layers=1, rows=2, length=8, slot=torch.tensor([3]))
    keys = torch.randn(2, 1, 3, 4, dtype=torch.bfloat16)
    cache.update(keys, keys, 0)
    assert cache.keys[0].dtype == torch.bfloat16 and cache.keys[0].shape == (2, 1, 8, 4)
    cache.decoding = True
    with pytest.raises(ValueError, match="arrive as torch.float32 but its cache holds torch.bfloat16"):
        cache.update(keys[:, :, :1].float(), keys[:, :, :1].float(), 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_steps_key_and_value_land_in_the_slot_in_one_launch(monkeypatch, dtype):
    """kv_cache.write_slot through the Triton kernel (the interpreter here) writes exactly what index_copy_ writes:
    the slot's column of every (row, head), nothing else; strided inputs (a transposed projection) and caches
    (a view of a longer one) read and written through their strides; one launch for keys and values."""
    import liger_patch_kd.generation.kv_cache as kv_cache

    from .helpers import count_launches

    launches = count_launches(monkeypatch, kv_cache, "_slot_write_kernel")
    monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    g = torch.Generator().manual_seed(7)
    long_keys, long_values = (torch.randn(3, 2, 12, 5, generator=g).to(DEVICE, dtype) for _ in range(2))
    keys, values = long_keys[:, :, :9], long_values[:, :, :9]  # a view: strides of the longer cache
    key = torch.randn(3, 1, 2, 5, generator=g).to(DEVICE, dtype).transpose(1, 2)  # (rows, heads, 1, dim), strided
    value = torch.randn(3, 2, 1, 5, generator=g).to(DEVICE, dtype)
    slot = torch.tensor([4], device=DEVICE)
    want_keys, want_values = keys.clone().index_copy_(2, slot, key), values.clone().index_copy_(2, slot, value)
    before = long_keys.clone()
    kv_cache.write_slot(keys, values, key, value, slot)
    assert len(launches) == 1
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
    assert torch.equal(long_keys[:, :, 9:], before[:, :, 9:])  # past the view: untouched


@pytest.mark.parametrize("slot", [-1, -3, 9, 10])
def test_a_slot_outside_the_cache_writes_nothing_anywhere(monkeypatch, slot):
    """kv_cache.write_slot with a slot before the cache's first column or past its last (the engine never asks for
    one) writes nothing: not the cache, and not the memory around it (a negative slot once wrote before it)."""
    from liger_patch_kd.generation.kv_cache import write_slot

    monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    long_keys, long_values = (torch.zeros(2, 3, 16, 8, device=DEVICE) for _ in range(2))
    keys, values = long_keys[:, :, 4:13], long_values[:, :, 4:13]  # columns 4..12 of longer buffers
    key, value = (torch.ones(2, 3, 1, 8, device=DEVICE) for _ in range(2))
    write_slot(keys, values, key, value, torch.tensor([slot], device=DEVICE))
    assert not long_keys.any() and not long_values.any()


def test_a_key_of_another_dtype_than_the_cache_is_refused_not_cast(monkeypatch):
    """write_slot keeps index_copy_'s contract: a float32 key into a bfloat16 cache is an error, not a silent cast."""
    from liger_patch_kd.generation.kv_cache import write_slot

    monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    keys, values = (torch.zeros(2, 3, 4, 8, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    key = torch.randn(2, 3, 1, 8, device=DEVICE)
    with pytest.raises(RuntimeError, match="same dtype"):
        write_slot(keys, values, key, key, torch.tensor([1], device=DEVICE))


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0  # nothing drawn outside the support
    expected = probs[keep] * counts.sum()
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    # The chi-square survival function is the regularised upper incomplete gamma Q(dof / 2, stat / 2).
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


@pytest.mark.parametrize("name", ["plain", "warped"])
def test_the_gumbel_draw_has_the_filtered_distribution(name):
    sampling = Sampling(temperature=0.7, top_k=6, top_p=0.8) if name == "warped" else Sampling()
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.2, 0.3]], dtype=torch.float64)
    scores = filtered_scores(logits, sampling)
    probs = scores.softmax(-1)[0]
    torch.manual_seed(0)
    tokens = draw(scores.expand(200_000, -1), sampling)
    counts = torch.bincount(tokens, minlength=10).double()
    # p < 1e-4 would fail a correct sampler once in 10,000 runs; a wrong one (a token's mass off by 1 %) fails
    assert _chi_square_p(counts, probs) > 1e-4
    if name == "warped":
        assert (probs > 0).sum() < 10  # the filters cut something


def test_engine_draws_the_models_first_token_distribution():
    """End to end: many copies of one prompt, one new token each: frequencies against the model's softmax."""
    model = _model("llama", torch.float64, seed=6, vocab=24)
    ids = torch.tensor([[5, 9, 13, 4]]).expand(6_000, -1).contiguous()
    with torch.no_grad():
        probs = model(input_ids=ids[:1]).logits[0, -1].softmax(-1)
    torch.manual_seed(1)
    tokens, _ = decode(model, ids, torch.ones_like(ids), max_new_tokens=1, sampling=Sampling(), pad_id=0)
    assert _chi_square_p(torch.bincount(tokens[:, 0], minlength=24).double(), probs) > 1e-4


def test_bad_input_is_refused_before_any_work():
    model = _model("llama", torch.float64)
    ids, mask = _prompts()
    with pytest.raises(ValueError, match="capture must be one of"):
        decode(model, ids, mask, max_new_tokens=2, sampling=Sampling(), pad_id=0, capture="paged")
    with pytest.raises(ValueError, match="max_new_tokens"):
        decode(model, ids, mask, max_new_tokens=0, sampling=Sampling(), pad_id=0)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0.0)
    for flag in ("temperature", "top_k", "top_p", "vocab_limit"):  # True was top_k=1: greedy, silently
        with pytest.raises(ValueError, match=f"{flag} must be a number, not a boolean"):
            Sampling(**{flag: True})
    model.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="attention is 'eager'"):
        decode(model, ids, mask, max_new_tokens=2, sampling=Sampling(), pad_id=0)
    assert CAPTURES == ("graph", "eager")


@pytest.mark.parametrize("top_p", [1e-300, 1e-50, 1e-6])
def test_a_top_p_below_float32s_least_keeps_the_most_likely_token(top_p):
    """top_p = 1e-300 compared as 0 against float32 masses: every token was dropped, the engine's draw then
    returned id 0 whatever the logits and the server's sampler a 500 (NaN probabilities)."""
    from liger_patch_kd.server.generation import GenerationRequest, sample_next

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    logits[:, 7] += 3.0
    scores = filtered_scores(logits, Sampling(top_p=top_p))
    assert torch.equal(torch.isfinite(scores), torch.nn.functional.one_hot(logits.argmax(-1), 50).bool())
    assert torch.equal(draw(scores, Sampling(top_p=top_p)), logits.argmax(-1))
    req = GenerationRequest(prompts=[[1]], n=1, temperature=1.0, top_p=top_p, top_k=0, max_tokens=1, seed=None,
                            logprobs=None, stop_ids=(), return_token_ids=True, model=None, allowed=None)  # fmt: skip
    assert torch.equal(sample_next(logits, req, torch.Generator().manual_seed(1)), logits.argmax(-1))

def _right_padded(ids, mask):
    return ids.roll(-3, 1), mask.roll(-3, 1)  # row 1's 3 padding columns moved to its end


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda ids, mask: (ids, mask.flip(1)), "must be left-padded"),  # right padding: would continue past it
        (_right_padded, "must be left-padded"),
        (lambda ids, mask: (ids, mask.masked_fill(torch.arange(5)[:, None] == 2, 0)), "must be left-padded"),  # empty
        (lambda ids, mask: (ids, mask * 2), "attention_mask must hold 0"),  # 2s would double the positions
        (lambda ids, mask: (ids.masked_fill(mask == 0, -100), mask), r"input_ids must be in \[0, 257\)"),
        (lambda ids, mask: (ids + 300, mask), r"got ids in \[300, "),
        (lambda ids, mask: (ids.float(), mask), "integer token ids"),
        (lambda ids, mask: (ids[:0], mask[:0]), "at least one row"),
        (lambda ids, mask: (torch.randint(5, 200, (2, 120)), torch.ones(2, 120, dtype=torch.long)),
         r"longest prompt \(120 tokens\) plus max_new_tokens \(9\) passes the model's context"),
    ],
)
def test_prompts_the_engine_would_sample_wrongly_from_are_refused(change, match):
    """Each of these used to decode without a word (a right-padded row continued from its padding, a mask of 2s
    doubled the position ids, 120 + 9 tokens ran past a 128-token context) or failed deep in the model."""
    model = _model("llama", torch.float64)
    ids, mask = change(*_prompts())
    with pytest.raises(ValueError, match=match) as raised:
        decode(model, ids, mask, max_new_tokens=9, sampling=Sampling(), pad_id=0, eos_ids=(3,))
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    "keywords, match",
    [
        (dict(check_every=0), "check_every must be an int >= 1"),  # was a ZeroDivisionError
        (dict(max_new_tokens=True), "max_new_tokens must be an int >= 1"),
        (dict(pad_id=-1), r"pad_id must be an id in \[0, 257\)"),  # would be written into the rows as an id
        (dict(eos_ids=(-5,)), "eos_ids must be ids >= 0"),
    ],
)
def test_decode_options_out_of_range_are_refused(keywords, match):
    model = _model("llama", torch.float64)
    ids, mask = _prompts()
    options = dict(max_new_tokens=4, sampling=Sampling(), pad_id=0, eos_ids=(3,)) | keywords
    with pytest.raises(ValueError, match=match):
        decode(model, ids, mask, **options)
    model.train()  # dropout would be sampled through
    with pytest.raises(ValueError, match=r"training mode .* call model.eval\(\) first"):
        decode(model, ids, mask, max_new_tokens=4, sampling=Sampling(), pad_id=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_cuda_graph_samples_what_the_eager_step_samples_and_sees_in_place_updates():
    model, ids, mask = _gpu_case()
    sampling = Sampling(temperature=0.9, top_k=50)
    runs = {}
    for capture in ("eager", "graph", "graph"):  # the second graph call replays the captured graph
        torch.manual_seed(11)
        runs.setdefault(capture, []).append(
            decode(model, ids, mask, max_new_tokens=12, sampling=sampling, pad_id=0, capture=capture)[0]
        )
    assert torch.equal(runs["graph"][0], runs["eager"][0]) and torch.equal(runs["graph"][1], runs["eager"][0])
    graph = session_of(model).graph
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    greedy = Sampling(temperature=0.0)
    decode(model, ids, mask, max_new_tokens=12, sampling=greedy, pad_id=0, capture="graph")  # capture (greedy)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0).add_(torch.randn_like(p) * 0.3)
    graph = session_of(model).graph
    got, _ = decode(model, ids, mask, max_new_tokens=12, sampling=greedy, pad_id=0, capture="graph")
    assert session_of(model).graph is graph  # replayed, not recaptured
    want, _ = reference(model, ids, mask, 12, greedy, 0, ())
    assert torch.equal(got, want)
    assert not math.isnan(float(got.sum()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_step_that_cannot_be_captured_raises_and_leaves_the_device_and_the_session_usable():
    """A host sync inside the step (here a hook) fails its capture: the call raises, the caller's stream is back,
    random ops work, and once the hook is gone the same bucket captures and samples what the eager step does."""
    model, ids, mask = _gpu_case()

    def sync_while_captured(module, args):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()

    hook = model.model.layers[0].register_forward_pre_hook(sync_while_captured)
    try:
        with pytest.raises(RuntimeError):
            decode(model, ids, mask, max_new_tokens=6, sampling=Sampling(), pad_id=0, capture="graph")
    finally:
        hook.remove()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    torch.randint(0, 10, (4,), device="cuda")  # torch's generator is out of capture mode
    runs = []
    for capture in ("eager", "graph"):
        torch.manual_seed(11)
        runs.append(decode(model, ids, mask, max_new_tokens=6, sampling=Sampling(), pad_id=0, capture=capture)[0])
    assert torch.equal(runs[0], runs[1])
    release_sessions(model)


def test_prompts_widened_on_the_left_decode_what_they_decode_as_given():
    """On CUDA the engine left-pads prompts to a multiple of PREFILL_WIDTH_MULTIPLE columns (few prefill graphs):
    the padding is masked and moves no position, so in float64 the tokens are the same and the log-probs agree to
    float64 rounding."""
    model = _model("llama", torch.float64, seed=5)
    ids, mask = _prompts()
    wide_ids, wide_mask = widened(ids, mask, 0, PREFILL_WIDTH_MULTIPLE)
    assert wide_ids.shape == (5, PREFILL_WIDTH_MULTIPLE) and torch.equal(wide_ids[:, -6:], ids)
    assert int(wide_mask[:, :-6].sum()) == 0 and torch.equal(wide_mask[:, -6:], mask)
    assert widened(wide_ids, wide_mask, 0, PREFILL_WIDTH_MULTIPLE)[0] is wide_ids  # a multiple already: as it is
    runs = []
    for prompt_ids, prompt_mask in ((ids, mask), (wide_ids, wide_mask)):
        torch.manual_seed(4)
        runs.append(decode(model, prompt_ids, prompt_mask, max_new_tokens=8, sampling=Sampling(), pad_id=0,
                           capture="eager", logprobs=True))  # fmt: skip
    assert torch.equal(runs[0][0], runs[1][0])
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=0, atol=1e-6)  # float32 log-probs of float64 logits
    release_sessions(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_prefill_is_captured_at_its_widths_second_call_and_replays_the_eager_prefill_and_in_place_updates():
    model, ids, mask = _gpu_case()
    sampling = Sampling(temperature=0.9, top_k=50)

    def sampled(capture):
        torch.manual_seed(11)
        return decode(model, ids, mask, max_new_tokens=12, sampling=sampling, pad_id=0, capture=capture)[0]

    want = sampled("eager")
    runs = [sampled("graph") for _ in range(3)]  # eager prefill, then captured, then replayed
    session = session_of(model)
    assert list(session.prefill_graphs) == [PREFILL_WIDTH_MULTIPLE]  # 6 columns widened to one multiple
    assert all(torch.equal(run, want) for run in runs)
    graph = session.prefill_graphs[PREFILL_WIDTH_MULTIPLE][0]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0).add_(torch.randn_like(p) * 0.3)
    got = sampled("graph")
    assert session.prefill_graphs[PREFILL_WIDTH_MULTIPLE][0] is graph  # replayed, reading the updated weights
    assert torch.equal(got, sampled("eager"))
    release_sessions(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_prefill_that_cannot_be_captured_runs_op_by_op_and_the_step_stays_captured():
    """A host sync in the prompt's forward only (a hook on the prefill's shapes) fails the prefill's capture: the
    call goes on with the prefill op by op, from then on, and samples what the eager capture samples."""
    model, ids, mask = _gpu_case()

    def sync_in_a_captured_prefill(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if torch.cuda.is_current_stream_capturing() and hidden.shape[1] > 1:
            torch.cuda.synchronize()

    hook = model.model.layers[0].register_forward_pre_hook(sync_in_a_captured_prefill, with_kwargs=True)
    try:
        runs = {}
        for capture in ("eager", "graph", "graph", "graph"):
            torch.manual_seed(11)
            runs.setdefault(capture, []).append(
                decode(model, ids, mask, max_new_tokens=6, sampling=Sampling(), pad_id=0, capture=capture)[0])
        session = session_of(model)
        assert not session.prefill_captures and not session.prefill_graphs and session.graph is not None
        assert all(torch.equal(run, runs["eager"][0]) for run in runs["graph"])
        assert torch.cuda.current_stream() == torch.cuda.default_stream()
        torch.randint(0, 10, (4,), device="cuda")  # torch's generator is out of capture mode
    finally:
        hook.remove()
        release_sessions(model)


def test_rollouts_through_the_graph_cache_are_the_engines_tokens_and_keep_eos():
    from liger_patch_kd.trainer.rollouts.generate import RolloutSettings, generate_rollouts

    model = _model("llama", torch.float64, seed=8)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    settings = RolloutSettings(max_new_tokens=6, cache="graph", seed=4, num_generations=2, vocab_size=250)
    eos = set(range(2, 120))  # many ending ids: rows end at different steps
    first = generate_rollouts(model, prompts, settings, pad_id=0, eos_ids=eos, start_id=1, step=3)
    again = generate_rollouts(model, prompts, settings, pad_id=0, eos_ids=eos, start_id=1, step=3)
    assert [r.completion for r in first] == [r.completion for r in again]  # seeded per (seed, step, call)
    assert any(r.finished for r in first) and all(r.completion[-1] in eos for r in first if r.finished)
    assert all(max(r.completion) < 250 for r in first)  # the padded head's extra ids are never drawn
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="kd_generation_cache='graph' cannot decode this generator"):
        generate_rollouts(model, prompts, settings, pad_id=0, eos_ids=eos, start_id=1)


@pytest.mark.parametrize("fuse", [True, False])
def test_the_servers_sampler_through_the_engine(fuse):
    """Both sampler settings (`liger-kd serve` fuses the projections unless --no-fused-projections): the model's
    own log-probs of the drawn tokens, reproducible per seed, the same tokens either way (float64)."""
    from liger_patch_kd.generation.engine import release_sessions, session_of
    from liger_patch_kd.server.generation import GenerationEngine, GenerationRequest

    model = _model("llama", torch.float64, seed=9)
    engine = GenerationEngine(model, "m", fuse_projections=fuse)
    engine.captured = True  # what a CUDA device sets; here the same step runs eagerly
    request = GenerationRequest(
        prompts=[[5, 6, 7], [8, 9]],
        n=2,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_tokens=5,
        seed=3,
        logprobs=0,
        stop_ids=tuple(range(3, 90)),
        return_token_ids=True,
        model=None,
    )
    reply = engine.complete(request)
    assert session_of(model).key.fuse is fuse
    assert reply == {**engine.complete(request), "id": reply["id"], "created": reply["created"]}  # seeded
    release_sessions(model)
    other = GenerationEngine(model, "m", fuse_projections=not fuse)
    other.captured = True
    assert [c["token_ids"] for c in other.complete(request)["choices"]] == [c["token_ids"] for c in reply["choices"]]
    for choice in reply["choices"]:
        toks, prompt = choice["token_ids"], choice["prompt_token_ids"]
        assert (choice["finish_reason"] == "stop") == (toks[-1] in request.stop_ids) and 1 <= len(toks) <= 5
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + toks[:-1]])).logits[0, len(prompt) - 1 :]
        want = logits.float().log_softmax(-1).gather(-1, torch.tensor(toks)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(choice["logprobs"]["token_logprobs"]), want, rtol=0, atol=1e-5)


def test_auto_takes_the_captured_step_on_cuda_where_the_engine_applies():
    from liger_patch_kd.trainer.rollouts.generate import cache_for

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert cache_for(64, cuda, "auto", engine_applies=True) == "graph"
    assert cache_for(64, cuda, "auto", engine_applies=False) == "static"
    assert cache_for(512, cuda, "auto", engine_applies=True) == "dynamic"  # not measured above 256 rows
    assert cache_for(8, cpu, "auto", engine_applies=True) == "dynamic"  # on a CPU: rollouts/decode.py
    assert cache_for(8, cpu, "graph") == "graph"


def test_a_session_heavier_than_a_tenth_of_the_run_is_released_after_a_call(monkeypatch):
    """release_if_large: kept while its bytes are <= 10 % of the memory allocated beside it (the training step's
    peak grows by at most that), released above; never on a CPU."""
    from liger_patch_kd.generation.engine import release_if_large, session_of

    model = _model("llama", torch.float64, seed=2)
    ids, mask = _prompts()
    decode(model, ids, mask, max_new_tokens=3, sampling=Sampling(), pad_id=0)
    session = session_of(model)
    held = session.nbytes()
    assert held >= session.cache.nbytes() > 0
    assert not release_if_large(model) and session_of(model) is session  # a CPU: kept
    session.device = torch.device("cuda")  # as a CUDA session would be, with the allocator's figure given
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: held + 10 * held)
    assert not release_if_large(model) and session_of(model) is session  # exactly a tenth: kept
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: held + 10 * held - 1)
    assert release_if_large(model) and session_of(model) is None


def test_the_servers_top_logprobs_through_the_engine_are_the_plain_loops():
    """logprobs K > 0 (top-K lists) through the engine's step: greedy, the same reply as the server's plain loop
    (tokens, finish reasons, each position's entries: the chosen token first, then the K most likely ids with the
    model's own log-probs, float64 model, float32 log-probs: equal to float32's rounding)."""
    from liger_patch_kd.server.generation import GenerationEngine, GenerationRequest

    model = _model("llama", torch.float64, seed=10)
    request = GenerationRequest(prompts=[[5, 6, 7], [8, 9]], n=1, temperature=0.0, top_p=1.0, top_k=0, max_tokens=5,
                                seed=3, logprobs=3, stop_ids=tuple(range(3, 60)), return_token_ids=True, model=None,
                                allowed=250)  # fmt: skip
    replies = {}
    for captured in (True, False):
        engine = GenerationEngine(model, "m")
        engine.captured = captured  # True: what a CUDA device sets (here the same step runs eagerly)
        replies[captured] = engine.complete(request)["choices"]
    assert session_of(model) is not None and session_of(model).key.top_logprobs == 3  # the engine took it
    for got, want in zip(replies[True], replies[False]):
        assert got["token_ids"] == want["token_ids"] and got["finish_reason"] == want["finish_reason"]
        tops_got, tops_want = got["logprobs"]["top_logprobs"], want["logprobs"]["top_logprobs"]
        assert [list(e) for e in tops_got] == [list(e) for e in tops_want] and all(len(e) >= 3 for e in tops_got)
        for entry_got, entry_want in zip(tops_got, tops_want):
            torch.testing.assert_close(torch.tensor(list(entry_got.values())), torch.tensor(list(entry_want.values())),
                                       rtol=0, atol=1e-6)  # fmt: skip
    release_sessions(model)


def test_top_logprobs_out_of_range_are_refused():
    model = _model("llama", torch.float64)
    ids, mask = _prompts()
    options = dict(max_new_tokens=2, sampling=Sampling(vocab_limit=20), pad_id=0)
    with pytest.raises(ValueError, match="top_logprobs must be an int >= 0"):
        decode(model, ids, mask, logprobs=True, top_logprobs=-1, **options)
    with pytest.raises(ValueError, match="pass logprobs=True with it"):
        decode(model, ids, mask, top_logprobs=2, **options)
    with pytest.raises(ValueError, match="more than the 20 ids that may be drawn"):
        decode(model, ids, mask, logprobs=True, top_logprobs=21, **options)
    tokens, logprobs, (top_ids, top_values) = decode(model, ids, mask, logprobs=True, top_logprobs=20, **options)
    assert top_ids.shape == (5, 2, 20) and bool((top_ids < 20).all())
    torch.testing.assert_close(top_values.exp().sum(-1), torch.ones(5, 2), rtol=0, atol=1e-5)  # all 20: the whole
    release_sessions(model)


@pytest.mark.parametrize("eos", [(), tuple(range(2, 5))])
def test_a_cancelled_decode_stops_at_the_next_step_and_the_next_call_is_unchanged(monkeypatch, eos):
    """decode(cancel=event): an event set during step 3 ends the call before step 4 runs (Cancelled, nothing
    returned); set before the call, not even the prefill runs. The session it leaves samples the next call exactly
    as a fresh session does (the same seed, the same tokens and log-probs)."""
    import threading

    from liger_patch_kd.generation import Cancelled
    from liger_patch_kd.generation.engine import DecodeSession

    model = _model("llama", torch.float64, seed=12)
    ids, mask = _prompts()
    options = dict(max_new_tokens=40, sampling=Sampling(), pad_id=0, eos_ids=eos, logprobs=True)
    torch.manual_seed(5)
    fresh = decode(model, ids, mask, **options)
    release_sessions(model)

    steps, prefills, cancel = [], [], threading.Event()
    run_step, prefill = DecodeSession.run_step, DecodeSession.prefill

    def counted_step(self):
        steps.append(1)
        if len(steps) == 3:
            cancel.set()  # as the server's event loop sets it, while the step runs
        run_step(self)

    def counted_prefill(self, *args):
        prefills.append(1)
        prefill(self, *args)

    monkeypatch.setattr(DecodeSession, "run_step", counted_step)
    monkeypatch.setattr(DecodeSession, "prefill", counted_prefill)
    with pytest.raises(Cancelled):
        decode(model, ids, mask, cancel=cancel, **options)
    assert len(steps) == 3 and len(prefills) == 1  # of 39 steps: none after the event was set
    with pytest.raises(Cancelled):
        decode(model, ids, mask, cancel=cancel, **options)  # already set: nothing runs
    assert len(steps) == 3 and len(prefills) == 1
    torch.manual_seed(5)
    again = decode(model, ids, mask, cancel=threading.Event(), **options)  # the cut-short session, reused
    assert len(prefills) == 2
    assert torch.equal(again[0], fresh[0]) and torch.equal(again[1], fresh[1])
    release_sessions(model)


def test_kept_sessions_that_weigh_on_memory_go_before_a_new_one_allocates(monkeypatch):
    """A model's kept CUDA sessions holding more than KEEP_FRACTION of the memory beside them (a large model's KV
    cache) weigh on memory: a new bucket releases them first, as one session at a time did; small ones, and a
    CPU's, are kept side by side."""
    from types import SimpleNamespace

    from liger_patch_kd.generation import engine

    def held(nbytes, kind="cuda"):
        return SimpleNamespace(device=torch.device(kind), nbytes=lambda: nbytes)

    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1000)
    assert not engine.weigh_on_memory([held(90)])  # 90 <= 0.1 * (1000 - 90)
    assert engine.weigh_on_memory([held(95)])  # 95 > 0.1 * 905
    assert engine.weigh_on_memory([held(50), held(50)])  # together
    assert not engine.weigh_on_memory([held(10**6, "cpu")]) and not engine.weigh_on_memory([])


@pytest.mark.parametrize("kernels", [True, False])
def test_a_dropped_model_takes_its_sessions_with_it(kernels):
    """Sessions are kept per model in a WeakKeyDictionary, so that a model's sessions (KV caches, weight copies) go
    with it. A kernels=False session runs the model itself: it refers to it weakly, else the value would keep its
    key, and so the model and its sessions, alive for good."""
    import gc
    import weakref

    model = _model("llama", torch.float32, seed=2)
    ids, mask = _prompts()
    decode(model, ids, mask, max_new_tokens=2, sampling=Sampling(), pad_id=0, capture="eager", kernels=kernels)
    assert len(sessions_of(model)) == 1
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None, "a kept session keeps the model alive"


def test_a_bucket_decoded_under_inference_mode_then_under_no_grad_decodes_both_times():
    """A call under torch.inference_mode builds its session's buffers as inference tensors; a call of the same
    bucket outside that mode (no_grad, as the Trainer's rollouts run) cannot update them in place: each mode has
    its own session, and both decode the same tokens."""
    model = _model("llama", torch.float32, seed=4)
    ids, mask = _prompts()
    runs = []
    for mode in (torch.inference_mode, torch.no_grad, torch.inference_mode):
        torch.manual_seed(3)
        with mode():
            runs.append(decode(model, ids, mask, max_new_tokens=4, sampling=Sampling(), pad_id=0, capture="eager"))
    release_sessions(model)
    assert all(torch.equal(runs[0][0], r[0]) for r in runs)


def test_prefill_widths_in_rotation_are_captured_once_each_and_at_most_prefill_graphs_of_them(monkeypatch):
    """A capture syncs and empties the allocator's cache: widths in rotation (a server's, varied prompts') must not
    be captured again and again. Each width is captured at its second call, the first PREFILL_GRAPHS widths only,
    and replayed after; the others run op by op. (The CUDA calls are stood in for: the bookkeeping alone.)"""
    import contextlib
    import types

    from liger_patch_kd.generation import engine

    captured = []
    monkeypatch.setattr(engine, "graph_capture", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 1))
    for name in ("get_rng_state", "memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda *a: None)
    session = object.__new__(engine.DecodeSession)
    session.key = types.SimpleNamespace(rows=8, capture="graph")
    session.device = torch.device("cpu")
    session.cache = types.SimpleNamespace(decoding=True)
    session.prefill_graphs, session.prefill_widths_seen, session.prefill_captures = {}, set(), True
    session.prefill_pool, session.prefill_pool_bytes = None, 0
    session.prefill_ops = lambda ids, mask: captured.append(ids.shape[1])
    widths = [16, 32, 48, 64, 80, 96] * 4
    replayed = [session.prefill_graph(width) is not None for width in widths]
    assert captured == [16, 32, 48, 64]  # once each, at the second round; 80 and 96 never
    assert sum(replayed) == 4 * 3 and not any(replayed[:6])
    assert session.prefill_graph(engine.PREFILL_CAPTURE_TOKENS // 8 + 16) is None  # too large: op by op
