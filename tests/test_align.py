"""Alignment of two tokenizations by character offsets, the vocabulary map and the collator."""

from __future__ import annotations

import pytest
import torch

from liger_patch_kd.align import CrossTokenizerCollator, VocabMap, align_tokens, byte_level_to_text, canonical_ends
from liger_patch_kd.align.offsets import encode_with_offsets
from liger_patch_kd.demo.cross_tokenizer import CharTokenizerWithOffsets, train_bpe_tokenizer


def spans(text: str, pieces: list[str], trim: bool = False) -> list[tuple[int, int]]:
    """Offsets of consecutive pieces of `text`; trim=True leaves leading spaces out (ByteLevel trim_offsets)."""
    out, pos = [], 0
    for piece in pieces:
        assert text.startswith(piece, pos)
        start = pos + (len(piece) - len(piece.lstrip(" ")) if trim else 0)
        out.append((start, pos + len(piece)))
        pos += len(piece)
    return out


def groups_as_text(text, s_off, t_off, **kw):
    """Each group as (student pieces, teacher pieces) of text, by canonical spans."""
    e_s, e_t = canonical_ends(s_off), canonical_ends(t_off)
    out = []
    for g in align_tokens(s_off, t_off, **kw):
        s = [text[e_s[j - 1] : e_s[j]] for j in range(g.s_first, g.s_last + 1)]
        t = [text[e_t[j - 1] : e_t[j]] for j in range(g.t_first, g.t_last + 1)]
        out.append((s, t, g.one_to_one))
    return out


def test_one_to_one_many_to_one_one_to_many_and_crossing():
    text = "<s>Hello world, friend"
    s = spans(text, ["<s>", "Hel", "lo", " world", ",", " fri", "end"])
    t = spans(text, ["<s>", "H", "ello", " wor", "ld", ",", " friend"])
    assert groups_as_text(text, s, t) == [
        (["Hel", "lo"], ["H", "ello"], False),  # crossing boundaries: merged on both sides
        ([" world"], [" wor", "ld"], False),  # one student token, two teacher tokens
        ([","], [","], True),  # one-to-one
        ([" fri", "end"], [" friend"], False),  # two student tokens, one teacher token
    ]


def test_only_one_to_one_groups_are_exact_eligible():
    text = "<s>abcde"
    s = spans(text, ["<s>", "a", "bc", "d", "e"])
    t = spans(text, ["<s>", "ab", "c", "d", "e"])
    assert groups_as_text(text, s, t) == [(["a", "bc"], ["ab", "c"], False), (["d"], ["d"], True), (["e"], ["e"], True)]


def test_trimmed_whitespace_offsets_align_with_untrimmed():
    text = "<s>the quick  fox"
    s = spans(text, ["<s>", "the", " quick", "  fox"], trim=True)  # ByteLevel trim_offsets: (4, 9) for " quick"
    t = spans(text, ["<s>", "the", " quick", " ", " fox"])
    assert groups_as_text(text, s, t) == [(["the"], ["the"], True), ([" quick"], [" quick"], True),
                                           (["  fox"], [" ", " fox"], False)]  # fmt: skip


def test_byte_pieces_of_one_character_never_split_a_group():
    text = "<s>a🙂b"  # the emoji is one character; byte-level tokenizers split it into pieces that all report it
    s = [(0, 3), (3, 4), (4, 5), (4, 5), (4, 5), (5, 6)]
    t = spans(text, ["<s>", "a", "🙂", "b"])
    assert canonical_ends(s) == [3, 4, 5, 5, 5, 6]
    got = [(g.s_first, g.s_last, g.t_first, g.t_last) for g in align_tokens(s, t)]
    assert got == [(1, 1, 1, 1), (2, 4, 2, 2), (3 + 2, 5, 3, 3)]
    # a piece straddling two characters: its end is no boundary
    s2 = [(0, 3), (3, 5), (4, 6)]
    assert canonical_ends(s2) == [3, 6, 6]


def test_zero_width_tokens_join_the_previous_token():
    text = "<s>ab"
    s = [(0, 3), (3, 4), (0, 0), (4, 5)]  # a special token reported at (0, 0) mid-sequence
    t = spans(text, ["<s>", "a", "b"])
    assert canonical_ends(s) == [3, 4, 4, 5]
    got = [(g.s_first, g.s_last, g.t_first, g.t_last) for g in align_tokens(s, t)]
    assert got == [(1, 2, 1, 1), (3, 3, 2, 2)]


def test_region_and_first_token_rules():
    text = "abcdef"
    s = spans(text, ["ab", "cd", "ef"])
    t = spans(text, ["a", "bcd", "ef"])
    # the group holding token 0 has no predicting row and is dropped
    assert [(g.s_first, g.t_first) for g in align_tokens(s, t)] == [(2, 2)]
    assert align_tokens(s, t, start_char=0, end_char=4) == []  # only boundaries 4 inside: no group
    assert align_tokens([], t) == []


def test_matches_gold_walk_on_ascii_completions():
    gold = pytest.importorskip("trl.experimental.gold.gold_trainer")
    bpe = train_bpe_tokenizer("the cat sat on the mat; the bat ate the rat " * 20, 300)
    char = CharTokenizerWithOffsets("abcdefghijklmnopqrstuvwxyz ;")
    for text in ["the cat sat", "a bat ate the mat; the rat", "  spaced  out ", "the"]:
        _, s_off = encode_with_offsets(bpe, text)
        _, t_off = encode_with_offsets(char, text)
        # GOLD walks end offsets of the completion tokens; prepend one prompt token so none is token 0
        s_groups, t_groups = gold.ULDLoss._align_by_byte_offsets(s_off, t_off)
        ours = align_tokens([(0, 0)] + s_off, [(0, 0)] + t_off, 0, len(text))
        # a zero-width prompt token sits at 0 on both sides, so group 0 starts right after it
        assert [list(range(g.s_first - 1, g.s_last)) for g in ours] == s_groups
        assert [list(range(g.t_first - 1, g.t_last)) for g in ours] == t_groups


def test_real_tokenizers_with_unicode_cover_the_same_text():
    text = "café 🙂 naïve — déjà vu!  über\tcool\nend"
    bpe = train_bpe_tokenizer("the cafe naive deja vu uber cool end " * 10, 280)
    char = CharTokenizerWithOffsets(text)
    s_ids, s_off = encode_with_offsets(bpe, text)
    assert len(s_ids) > len(text.encode()) // 4  # byte-level pieces of the unseen characters are there
    _, t_off = encode_with_offsets(char, text)
    groups = groups_as_text(text, [(0, 0)] + s_off, [(0, 0)] + t_off)
    assert "".join("".join(s) for s, _, _ in groups) == text  # the groups tile the text
    for s, t, _ in groups:
        assert "".join(s) == "".join(t)
    emoji = [t for s, t, _ in groups if "🙂" in "".join(s)]
    assert emoji and all(len(x) == 1 for x in emoji[0][:1])


def test_vocab_map_matches_strings_and_normalised_forms():
    student = {"<pad>": 0, "Ġthe": 1, "a": 2, "Ġ": 3, "Ã©": 4, "zz": 5}
    teacher = {"<pad>": 0, "▁the": 7, "a": 3, " ": 5, "é": 6, "qq": 1}
    plain = VocabMap.build(student, teacher)
    assert plain.student_ids.tolist() == [0, 2] and plain.teacher_ids.tolist() == [0, 3]
    norm = VocabMap.build(student, teacher, normalize=byte_level_to_text)
    assert dict(zip(norm.student_ids.tolist(), norm.teacher_ids.tolist())) == {0: 0, 1: 7, 2: 3, 3: 5, 4: 6}
    small = VocabMap.build(student, teacher, normalize=byte_level_to_text, teacher_vocab_size=6)
    assert 7 not in small.teacher_ids.tolist() and 6 not in small.teacher_ids.tolist()
    with pytest.raises(ValueError, match="lm_heads have"):
        norm.check(3, 8)


def _chat_tokenizer(tok, template: str):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = template
    return fast


CHATML = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
BRACKETS = (
    "<s>{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }}</s>{% endif %}{% endfor %}"
)


def test_collator_with_two_chat_templates_scores_the_completion_only():
    corpus = "the user asks: what is a cat? the cat is an animal. " * 30
    student = _chat_tokenizer(train_bpe_tokenizer(corpus, 300), CHATML)
    teacher = _chat_tokenizer(train_bpe_tokenizer(corpus.upper() + corpus, 330), BRACKETS)
    examples = [
        {"messages": [{"role": "user", "content": "what is a cat?"}, {"role": "assistant", "content": "an animal."}]},
        {"messages": [{"role": "user", "content": "and café?"}, {"role": "assistant", "content": "a café is 🙂"}]},
    ]
    batch = CrossTokenizerCollator(student, teacher, student_pad_id=0, teacher_pad_id=0)(examples)
    groups_s, groups_t = batch["student_align_groups"], batch["teacher_align_groups"]
    assert torch.equal(groups_s[groups_s >= 0].unique(), groups_t[groups_t >= 0].unique())
    for b, example in enumerate(examples):
        content = example["messages"][-1]["content"]
        decoded = []
        for ids_key, groups, tok in (("input_ids", groups_s, student), ("teacher_input_ids", groups_t, teacher)):
            ids = batch[ids_key][b]
            # row r's group concerns token r + 1: the groups' tokens decode to the completion's content, less
            # the first word where the teacher's template token " an" straddles the content's start
            tokens = [int(ids[r + 1]) for r in range(ids.numel() - 1) if groups[b, r] >= 0]
            decoded.append(tok.decode(tokens))
        assert decoded[0] == decoded[1] and content.endswith(decoded[0])
        assert decoded[0] == content[content.index(" ") :]
        labels = batch["labels"][b]
        scored = tok_decode = student.decode(batch["input_ids"][b][labels != -100].tolist())
        assert scored.startswith(content) and scored.endswith("</s>\n")  # content + the student's end of turn
        assert "user" not in tok_decode
        # each group has the same id on both sides, in order
        s_ids = groups_s[b][groups_s[b] >= 0].unique_consecutive()
        t_ids = groups_t[b][groups_t[b] >= 0].unique_consecutive()
        assert torch.equal(s_ids, t_ids)
    teacher_rows = batch["teacher_labels"] != -100
    assert teacher_rows.sum() == (groups_t >= 0).sum()


def test_collator_rejects_unusable_examples():
    char = CharTokenizerWithOffsets("abc")
    collate = CrossTokenizerCollator(char, char)
    with pytest.raises(ValueError, match="'messages' or 'prompt' \\(\\+ 'completion'\\)"):
        collate([{"text": "abc"}])
    with pytest.raises(ValueError, match="end with the assistant"):
        collate([{"messages": [{"role": "user", "content": "a"}]}])


def test_first_byte_classes_by_tokenizer_kind():
    from liger_patch_kd.align.vocab import NO_BYTE, first_byte_classes, token_first_byte

    assert token_first_byte("Ġthe", byte_level=True) == 32 and token_first_byte("ð", byte_level=True) == 0xF0
    assert token_first_byte("é", byte_level=False) == 0xC3  # text, not a byte-level symbol
    assert token_first_byte("▁the", byte_level=False) == 32 and token_first_byte("<0xE2>", byte_level=False) == 0xE2
    char = CharTokenizerWithOffsets("ab é")
    classes = first_byte_classes(char, len(char))
    assert classes[:3].tolist() == [NO_BYTE] * 3  # pad, bos, eos
    assert sorted(classes[3:].tolist()) == sorted([32, 97, 98, 0xC3])
    bpe = train_bpe_tokenizer("ab é ab é", 262)
    bpe_classes = first_byte_classes(bpe, bpe.get_vocab_size())
    assert bpe_classes[bpe.token_to_id("<s>")] == NO_BYTE and bpe_classes[bpe.token_to_id("Ġ")] == 32
