"""The cross-tokenizer loss: fused against the plain reference (float64), against TRL's GOLD on tiny models with
two different tokenizers, and the top-k ULD against the full sort."""

from __future__ import annotations

import types

import pytest
import torch

from liger_patch_kd.align import CrossTokenizerConfig, VocabMap, align_tokens, fused_linear_cross_tokenizer_kd
from liger_patch_kd.align import reference as xref
from liger_patch_kd.align.chain import TokenTrie
from liger_patch_kd.align.offsets import encode_with_offsets
from liger_patch_kd.demo import load_corpus
from liger_patch_kd.demo.cross_tokenizer import CharTokenizerWithOffsets, train_bpe_tokenizer


def random_case(seed=0, dtype=torch.float64, bias=False, leading_s=(2, 9), leading_t=(2, 11), v_s=53, v_t=41):
    """Random hidden states and heads with a hand-made alignment: groups of 1-3 rows on each side."""
    g = torch.Generator().manual_seed(seed)
    h_s = torch.randn(*leading_s, 8, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w_s = (torch.randn(v_s, 8, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    b_s = (torch.randn(v_s, generator=g, dtype=torch.float64)).to(dtype).requires_grad_() if bias else None
    h_t = torch.randn(*leading_t, 6, generator=g, dtype=torch.float64).to(dtype)
    w_t = torch.randn(v_t, 6, generator=g, dtype=torch.float64).to(dtype)
    s_labels = torch.randint(0, v_s, leading_s, generator=g)
    t_labels = torch.randint(0, v_t, leading_t, generator=g)
    s_groups = torch.tensor([[-1, 0, 1, 1, 2, 3, 3, 3, -1], [-1, -1, 4, 5, 5, 6, 7, -1, -1]])
    t_groups = torch.tensor([[-1, 0, 0, 1, 2, 2, 2, 3, -1, -1, -1], [-1, 4, 5, 6, 6, 6, 7, 7, -1, -1, -1]])
    s_labels[0, 0] = -100  # a prompt row
    s_labels[1, -1] = -100
    exact_ok = torch.rand(leading_s, generator=g) > 0.4
    # first-byte classes: a few bytes shared, some only on one side, a special class
    s_bytes = torch.randint(60, 70, (v_s,), generator=g)
    t_bytes = torch.randint(62, 72, (v_t,), generator=g)
    s_bytes[:2], t_bytes[:1] = 256, 256
    # kind="chain": student texts of 1-4 bytes over 3 of the teacher's first bytes (so prefixes are shared),
    # teacher tokens of 1-2 bytes; ids 0 and 1 special (no text)
    lengths, letters = torch.randint(1, 5, (v_s,), generator=g), torch.randint(63, 66, (v_s, 4), generator=g)
    texts = [b""] * 2 + [bytes(letters[i, : lengths[i]].tolist()) for i in range(2, v_s)]
    t_len = torch.randint(1, 3, (v_t,), generator=g)
    t_len[0] = 0
    vocab_map = VocabMap(torch.tensor([0, 2, 3, 7, 11, 30, 52]), torch.tensor([1, 2, 5, 6, 9, 17, 40]), v_s, v_t,
                         s_bytes, t_bytes, TokenTrie.build(texts), t_len)  # fmt: skip
    return dict(h_s=h_s, w_s=w_s, b_s=b_s, h_t=h_t, w_t=w_t, s_labels=s_labels, t_labels=t_labels,
                s_groups=s_groups, t_groups=t_groups, exact_ok=exact_ok, vocab_map=vocab_map)  # fmt: skip


def reference_loss(c, cfg):
    s_logits = c["h_s"] @ c["w_s"].T + (0 if c["b_s"] is None else c["b_s"])
    t_logits = c["h_t"] @ c["w_t"].T
    return xref.cross_tokenizer_kd_loss(
        s_logits.double(), t_logits.double(), c["s_labels"], c["t_labels"], c["s_groups"], c["t_groups"],
        c["vocab_map"], c["exact_ok"], cfg,
    )  # fmt: skip


def fused_loss(c, cfg, **kw):
    return fused_linear_cross_tokenizer_kd(
        c["h_s"], c["w_s"], c["h_t"], c["w_t"], c["s_labels"], c["t_labels"], c["s_groups"], c["t_groups"],
        c["vocab_map"], c["exact_ok"], config=cfg, student_bias=c["b_s"], **kw,
    )  # fmt: skip


def grads(loss, c, weight=None):
    params = [p for p in (c["h_s"], c["w_s"], c["b_s"]) if p is not None]
    return torch.autograd.grad(loss if weight is None else (loss * weight).sum(), params)


@pytest.mark.parametrize("kind", ["uld", "exact", "hybrid", "next_byte", "chain"])
@pytest.mark.parametrize("top_k", [None, 4, 1000])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_fused_matches_reference(kind, top_k, beta):
    c = random_case(bias=True)
    cfg = CrossTokenizerConfig(kind=kind, uld_top_k=top_k, beta=beta, temperature=1.7, hard_weight=0.4,
                               exact_weight=0.7, uld_weight=1.3, chunk_size=5)  # fmt: skip
    ref, fused = reference_loss(c, cfg), fused_loss(c, cfg)
    torch.testing.assert_close(fused, ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads(fused, c), grads(ref, c)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("reduction", ["batchmean", "sum", "none"])
@pytest.mark.parametrize("unmatched", ["bucket", "ignore", "next_byte", "chain"])
@pytest.mark.parametrize("chunk_size", [1, 3, 64])
def test_reductions_unmatched_policies_and_chunks(reduction, unmatched, chunk_size):
    c = random_case(seed=1)
    kind, unmatched = (unmatched, "bucket") if unmatched in ("next_byte", "chain") else ("hybrid", unmatched)
    cfg = CrossTokenizerConfig(kind=kind, unmatched=unmatched, reduction=reduction, softcap=3.0,
                               teacher_softcap=2.0, chunk_size=chunk_size, beta=0.3)  # fmt: skip
    ref, fused = reference_loss(c, cfg), fused_loss(c, cfg)
    torch.testing.assert_close(fused, ref, rtol=1e-10, atol=1e-12)
    weight = torch.rand_like(ref) if reduction == "none" else None
    for a, b in zip(grads(fused, c, weight), grads(ref, c, weight)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_num_items_in_batch_components_and_float32():
    c = random_case(seed=2, dtype=torch.float32)
    cfg = CrossTokenizerConfig(hard_weight=0.5, soft_weight=2.0)
    out = fused_loss(c, cfg, num_items_in_batch=40, return_components=True)
    ref = reference_loss(c, cfg.replace(reduction="sum")) / 40
    torch.testing.assert_close(out.loss.double(), ref, rtol=1e-5, atol=1e-6)
    soft = reference_loss(c, cfg.replace(reduction="sum", hard_weight=0.0, soft_weight=1.0)) / 40
    torch.testing.assert_close(out.soft.double(), soft, rtol=1e-5, atol=1e-6)
    assert not out.soft.requires_grad and out.loss.requires_grad


def test_no_groups_and_no_labels_give_zero_and_zero_grads():
    c = random_case(seed=3)
    c["s_groups"] = torch.full_like(c["s_groups"], -1)
    c["t_groups"] = torch.full_like(c["t_groups"], -1)
    c["s_labels"] = torch.full_like(c["s_labels"], -100)
    loss = fused_loss(c, CrossTokenizerConfig(hard_weight=1.0))
    assert float(loss.detach()) == 0.0
    assert all(float(g.abs().sum()) == 0.0 for g in grads(loss, c))


def test_bad_inputs_are_clear_errors():
    c = random_case()
    bad = dict(c, t_groups=torch.where(c["t_groups"] == 7, -1, c["t_groups"]))
    with pytest.raises(ValueError, match="same groups"):
        fused_loss(bad, CrossTokenizerConfig())
    split = c["t_groups"].clone()
    split[0, 9] = 0  # group 0 in two runs
    with pytest.raises(ValueError, match="consecutive rows"):
        fused_loss(dict(c, t_groups=split), CrossTokenizerConfig())
    with pytest.raises(ValueError, match="leading shape"):
        fused_loss(dict(c, s_labels=c["s_labels"][:, :-1]), CrossTokenizerConfig())
    with pytest.raises(ValueError, match="needs a non-empty vocab_map"):
        fused_loss(dict(c, vocab_map=None), CrossTokenizerConfig(kind="hybrid"))
    unlabelled = c["s_labels"].clone()
    unlabelled[0, 1] = -100
    with pytest.raises(ValueError, match="rows that are in a group"):
        fused_loss(dict(c, s_labels=unlabelled), CrossTokenizerConfig())
    with pytest.raises(ValueError, match="kind must be one of"):
        CrossTokenizerConfig(kind="kl")
    with pytest.raises(ValueError, match="uld_top_k"):
        CrossTokenizerConfig(uld_top_k=0)


def test_topk_uld_is_a_lower_bound_within_twice_the_smaller_tail():
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(64, 3000, generator=g, dtype=torch.float64) * 3, -1) * 0.7  # merged: mass < 1
    p = torch.softmax(torch.randn(64, 2000, generator=g, dtype=torch.float64) * 3, -1)
    full = xref.sorted_l1(q, p)
    for k in (8, 64, 512):
        approx = xref.sorted_l1(q, p, k)
        tails = torch.minimum(q.sum(-1) - q.topk(k).values.sum(-1), p.sum(-1) - p.topk(k).values.sum(-1))
        assert bool((approx <= full + 1e-12).all()) and bool((full - approx <= 2 * tails + 1e-12).all())
    torch.testing.assert_close(xref.sorted_l1(q, p, 3000), full)


# ------------------------------------------------------------------------------------------- TRL GOLD parity
def _tiny_llama(vocab, seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg).double().eval()


class _VocabOnly:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return self.vocab


def _sequences(tok, pairs):
    """[<s>] + prompt + completion per pair, GOLD's unshifted completion labels, completion-relative offsets."""
    ids, labels, offsets = [], [], []
    for prompt, completion in pairs:
        p_ids, _ = encode_with_offsets(tok, prompt)
        c_ids, c_off = encode_with_offsets(tok, completion)
        n = 1 + len(p_ids)
        ids.append([1] + p_ids + c_ids)
        labels.append([-100] * n + c_ids)
        offsets.append([(0, 0)] * n + list(c_off))
    width = max(len(x) for x in ids)
    pad = lambda rows, fill: [r + [fill] * (width - len(r)) for r in rows]  # noqa: E731
    return torch.tensor(pad(ids, 0)), torch.tensor(pad(labels, -100)), torch.tensor(pad(offsets, (0, 0)))


@pytest.mark.parametrize("hybrid", [False, True])
def test_parity_with_trl_gold_on_two_tokenizers(hybrid):
    gold = pytest.importorskip("trl.experimental.gold.gold_trainer")
    corpus = load_corpus()
    char = CharTokenizerWithOffsets(corpus)
    bpe = train_bpe_tokenizer(corpus[:20000], 300)
    pairs = [("In the evening, ", "the old fox sees a cat."), ("At dawn, a ", "fox and an owl, 8 or 9.")]
    s_ids, s_lab, s_off = _sequences(bpe, pairs)
    t_ids, t_lab, t_off = _sequences(char, pairs)
    student, teacher = _tiny_llama(bpe.get_vocab_size(), 0), _tiny_llama(len(char), 1)
    with torch.no_grad():
        s_logits, t_logits = student(input_ids=s_ids).logits, teacher(input_ids=t_ids).logits
    gold_cfg = types.SimpleNamespace(
        uld_crossentropy_weight=0.0, uld_distillation_weight=1.0, uld_student_temperature=1.0,
        uld_teacher_temperature=1.0, uld_skip_student_eos=False, uld_skip_teacher_eos=False, use_extended_uld=True,
        uld_token_merge_strategy="bayesian", uld_use_hybrid_loss=hybrid, uld_hybrid_matched_weight=0.6,
        uld_hybrid_unmatched_weight=1.5, beta=0.0,
    )  # fmt: skip
    uld = gold.ULDLoss(gold_cfg, _VocabOnly(bpe.get_vocab()), _VocabOnly(char.get_vocab()))
    expected = uld(s_logits, t_logits, s_lab, t_lab, s_ids, t_ids, s_off, t_off)

    # ours: the aligner on the same offsets, HF-shifted rows, every group exact-eligible and unmatched="ignore"
    s_groups, t_groups = torch.full_like(s_ids, -1), torch.full_like(t_ids, -1)
    n, per_sequence = 0, []
    for b in range(len(pairs)):
        s_len, t_len = int((s_lab[b] != -100).nonzero().max()) + 1, int((t_lab[b] != -100).nonzero().max()) + 1
        groups = align_tokens(
            [tuple(o) for o in s_off[b, :s_len].tolist()], [tuple(o) for o in t_off[b, :t_len].tolist()]
        )
        first = n
        for grp in groups:
            s_groups[b, grp.s_first - 1 : grp.s_last] = n
            t_groups[b, grp.t_first - 1 : grp.t_last] = n
            n += 1
        per_sequence.append((first, n))
    shift = lambda t: torch.cat([t[:, 1:], torch.full_like(t[:, :1], -100)], 1)  # noqa: E731
    vocab_map = VocabMap.build(bpe.get_vocab(), char.get_vocab())
    cfg = CrossTokenizerConfig(kind="hybrid" if hybrid else "uld", exact_weight=0.6, uld_weight=1.5, beta=0.0,
                               unmatched="ignore", reduction="none")  # fmt: skip
    h_s = student.model(input_ids=s_ids).last_hidden_state.detach().requires_grad_()
    h_t = teacher.model(input_ids=t_ids).last_hidden_state.detach()
    per_row = fused_linear_cross_tokenizer_kd(
        h_s, student.lm_head.weight, h_t, teacher.lm_head.weight, shift(s_lab), shift(t_lab), s_groups, t_groups,
        vocab_map, None, config=cfg,
    )  # fmt: skip
    counts = [b - a for a, b in per_sequence]
    ours = sum(per_row[b].sum() / counts[b] for b in range(2)) / 2  # GOLD: mean over groups, then over sequences
    # GOLD clamps probabilities at 1e-8 in its matched term; the check is exact only where nothing is that small
    log_q = xref.merged_log_probs(s_logits.reshape(-1, s_logits.shape[-1]), shift(s_lab).reshape(-1).clamp(min=0),
                                  s_groups.reshape(-1), n)  # fmt: skip
    log_p = xref.merged_log_probs(t_logits.reshape(-1, t_logits.shape[-1]), shift(t_lab).reshape(-1).clamp(min=0),
                                  t_groups.reshape(-1), n)  # fmt: skip
    assert float(log_q.exp().min()) > 1e-8 and float(log_p.exp().min()) > 1e-8
    torch.testing.assert_close(ours, expected.double(), rtol=1e-9, atol=1e-12)


def test_chain_masses_and_depths_by_hand():
    """kind="chain" on a 5-token trie: the student's next byte at each depth of its token, given the text so far."""
    from liger_patch_kd.align.chain import allowed_classes, chain_pairs, continuation_masses

    texts = [b"", b"a", b"ab", b"ac", b"b", b"abc"]  # id 0 special
    trie = TokenTrie.build(texts)
    probs = torch.tensor([[0.05, 0.1, 0.2, 0.3, 0.15, 0.2]], dtype=torch.float64)
    label = torch.tensor([5])  # the next token is "abc"
    mass, member, byte = continuation_masses(probs, label, 0, trie)
    assert mass[0, ord("a")] == pytest.approx(0.1 + 0.2 + 0.3 + 0.2) and mass[0, ord("b")] == pytest.approx(0.15)
    assert mass.sum() == pytest.approx(0.95)  # the special token has no first byte
    mass, member, byte = continuation_masses(probs, label, 1, trie)  # after "a": "ab", "ac", "abc" go on
    assert mass[0, ord("b")] == pytest.approx(0.2 + 0.2) and mass[0, ord("c")] == pytest.approx(0.3)
    assert mass.sum() == pytest.approx(0.7)  # "a" itself ends there
    mass, member, byte = continuation_masses(probs, label, 2, trie)  # after "ab": only "abc"
    assert mass[0, ord("c")] == pytest.approx(0.2) and mass.sum() == pytest.approx(0.2)
    teacher = torch.zeros(1, 257, dtype=torch.float64)
    teacher[0, ord("c")], teacher[0, ord("z")] = 0.6, 0.4  # "z": where the student's token would end instead
    allowed = allowed_classes(member, byte, teacher)
    assert allowed.sum() == 1 and allowed[0, ord("c")]
    assert not allowed_classes(member, byte, torch.zeros_like(teacher)).any()  # no teacher mass there: skipped
    # a group of 3 teacher tokens of 1, 2, 1 bytes over a 3-byte student token, then a group over a 1-byte one
    depth, scored = chain_pairs(torch.tensor([0, 0, 0, 1]), torch.tensor([3, 1]), torch.tensor([1, 2, 1, 1]), 32)
    assert depth.tolist() == [0, 1, 3, 0] and scored.tolist() == [True, True, False, True]


def test_chain_loss_is_zero_when_the_student_matches_the_teacher():
    """A character teacher whose next-character probabilities are the student's own conditionals gives 0."""
    texts = [b"", b"a", b"b", b"ab", b"ba"]
    trie = TokenTrie.build(texts)
    s_logits = torch.tensor([[0.0, 0.2, -0.3, 1.1, 0.4]], dtype=torch.float64)
    s = torch.softmax(s_logits, -1)[0]
    # teacher ids: 0 special, 1 "a", 2 "b"; the student's token is "ab" (group: student row 0, teacher rows 0-1)
    depth0 = torch.tensor([0.0, s[1] + s[3], s[2] + s[4]])  # next byte overall
    depth1 = torch.tensor([0.0, 0.0, 1.0])  # after "a" only "ab" goes on, with "b"
    t_logits = torch.stack([depth0, depth1]).clamp(min=1e-300).log()
    vocab_map = VocabMap(torch.tensor([1, 2]), torch.tensor([1, 2]), 5, 3, torch.tensor([256, 97, 98, 97, 98]),
                         torch.tensor([256, 97, 98]), trie, torch.tensor([0, 1, 1]))  # fmt: skip
    loss = xref.cross_tokenizer_kd_loss(
        s_logits, t_logits, torch.tensor([3]), torch.tensor([1, 2]), torch.tensor([0]), torch.tensor([0, 0]),
        vocab_map, config=CrossTokenizerConfig(kind="chain", reduction="sum"),
    )  # fmt: skip
    assert abs(float(loss)) < 1e-12
    off = xref.cross_tokenizer_kd_loss(
        s_logits, t_logits.flip(-1), torch.tensor([3]), torch.tensor([1, 2]), torch.tensor([0]), torch.tensor([0, 0]),
        vocab_map, config=CrossTokenizerConfig(kind="chain", reduction="sum"),
    )  # fmt: skip
    assert float(off) > 0.01


def test_reduction_none_backward_under_bf16_autocast_is_the_backward_outside_it():
    """reduction="none" recomputes the chunks in the backward: called inside the autocast block (fp32 weights,
    bf16=True), the recomputed student logits must stay fp32 as the forward's were (they were rounded to bf16
    before the softmax, ~1e-2 of every probability's gradient). Same gradients, bit for bit, either way."""
    c = random_case(dtype=torch.float32)
    for k in ("h_s", "w_s"):
        c[k] = (c[k] * 0.8).detach().requires_grad_()
    cfg = CrossTokenizerConfig(kind="uld", reduction="none")
    upstream = torch.randn(c["s_labels"].shape)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = grads(fused_loss(c, cfg), c, upstream)
        loss = fused_loss(c, cfg)
    outside = grads(loss, c, upstream)
    assert all(torch.equal(a, b) for a, b in zip(inside, outside))
