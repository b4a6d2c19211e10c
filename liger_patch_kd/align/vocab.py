"""The vocabulary map between two tokenizers, built once: token strings present in both vocabularies.

Teacher mass on tokens the student lacks (and student mass on tokens the teacher lacks) is never dropped
silently: the exact-token term either lumps it into one "other" class on both sides (`unmatched="bucket"`,
the default: a proper divergence between two (M + 1)-class distributions) or, as TRL's GOLD does, leaves it
out of the exact term (`unmatched="ignore"`); in the hybrid loss the unmatched tokens' probabilities are
compared by ULD (sorted, so no token correspondence is needed).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from .chain import NO_BYTE, TokenTrie


def vocabulary_of(tokenizer) -> dict[str, int]:
    """token string -> id, from an HF tokenizer, a `tokenizers.Tokenizer` or anything with get_vocab()."""
    if hasattr(tokenizer, "get_vocab"):
        return dict(tokenizer.get_vocab())
    raise ValueError(f"tokenizer of type {type(tokenizer).__name__} has no get_vocab(); pass a vocabulary dict")


@dataclass(frozen=True)
class VocabMap:
    """Pairs (student id, teacher id) whose token strings are equal (after `normalize`), sorted by student id."""

    student_ids: torch.Tensor  # (M,) int64
    teacher_ids: torch.Tensor  # (M,) int64
    student_vocab_size: int
    teacher_vocab_size: int
    # each token's first UTF-8 byte (NO_BYTE for special and empty tokens), for kind="next_byte"
    student_first_byte: torch.Tensor | None = None  # (V_s,) int64
    teacher_first_byte: torch.Tensor | None = None  # (V_t,) int64
    # for kind="chain": the student's token texts as a byte trie, the byte length of each teacher token's text
    student_trie: TokenTrie | None = None
    teacher_byte_len: torch.Tensor | None = None  # (V_t,) int64

    @classmethod
    def build(
        cls,
        student_vocab: Mapping[str, int] | object,
        teacher_vocab: Mapping[str, int] | object,
        *,
        student_vocab_size: int | None = None,
        teacher_vocab_size: int | None = None,
        normalize: Callable[[str], str] | None = None,
        student_byte_level: bool | None = None,
        teacher_byte_level: bool | None = None,
    ) -> VocabMap:
        """From two vocabularies (dicts or tokenizers). `*_vocab_size` is the lm_head's row count (ids at or above
        it are dropped; default: max id + 1). `normalize` maps a token string to a canonical form before
        matching, e.g. `byte_level_to_text` to match GPT-2 style "Ġthe" with SentencePiece "▁the"; a string that
        two ids of one vocabulary share after normalising is matched by its lowest id. `*_byte_level` says
        whether token strings are GPT-2 byte-level (detected from a tokenizer; False for a dict)."""
        s_vocab = student_vocab if isinstance(student_vocab, Mapping) else vocabulary_of(student_vocab)
        t_vocab = teacher_vocab if isinstance(teacher_vocab, Mapping) else vocabulary_of(teacher_vocab)
        v_s = student_vocab_size or max(s_vocab.values()) + 1
        v_t = teacher_vocab_size or max(t_vocab.values()) + 1
        canon = normalize or (lambda s: s)

        def index(vocab: Mapping[str, int], size: int) -> dict[str, int]:
            out: dict[str, int] = {}
            for token, i in sorted(vocab.items(), key=lambda kv: kv[1]):
                if i < size:
                    out.setdefault(canon(token), i)
            return out

        s_index, t_index = index(s_vocab, v_s), index(t_vocab, v_t)
        pairs = sorted((s_index[k], t_index[k]) for k in s_index.keys() & t_index.keys())
        s_ids = torch.tensor([p[0] for p in pairs], dtype=torch.long)
        t_ids = torch.tensor([p[1] for p in pairs], dtype=torch.long)
        s_texts = token_texts(student_vocab, v_s, student_byte_level)
        t_texts = token_texts(teacher_vocab, v_t, teacher_byte_level)
        t_len = torch.tensor([len(t) for t in t_texts], dtype=torch.long)
        return cls(s_ids, t_ids, v_s, v_t, first_bytes(s_texts), first_bytes(t_texts), TokenTrie.build(s_texts), t_len)

    def __len__(self) -> int:
        return int(self.student_ids.numel())

    def with_pairs(self, pairs: list[tuple[int, int]]) -> VocabMap:
        """This map plus (student id, teacher id) pairs whose ids it maps to nothing yet (special tokens whose
        strings differ but whose meaning is the same, such as the two EOS tokens), still sorted by student id."""
        s_have, t_have = set(self.student_ids.tolist()), set(self.teacher_ids.tolist())
        bad = [(s, t) for s, t in pairs if not (0 <= s < self.student_vocab_size and 0 <= t < self.teacher_vocab_size)]
        if bad:
            raise ValueError(f"pairs {bad} lie outside the vocabularies ({self.student_vocab_size} student / "
                             f"{self.teacher_vocab_size} teacher ids)")  # fmt: skip
        new = [(s, t) for s, t in pairs if s not in s_have and t not in t_have]
        if not new:
            return self
        both = sorted([*zip(self.student_ids.tolist(), self.teacher_ids.tolist()), *new])
        s_ids = torch.tensor([p[0] for p in both], dtype=torch.long, device=self.student_ids.device)
        t_ids = torch.tensor([p[1] for p in both], dtype=torch.long, device=self.teacher_ids.device)
        return dataclasses.replace(self, student_ids=s_ids, teacher_ids=t_ids)

    def to(self, device: torch.device | str) -> VocabMap:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return VocabMap(move(self.student_ids), move(self.teacher_ids), self.student_vocab_size,
                        self.teacher_vocab_size, move(self.student_first_byte), move(self.teacher_first_byte),
                        None if self.student_trie is None else self.student_trie.to(device),
                        move(self.teacher_byte_len))  # fmt: skip

    def check(self, student_vocab_size: int, teacher_vocab_size: int) -> None:
        if len(self) and (
            int(self.student_ids.max()) >= student_vocab_size or int(self.teacher_ids.max()) >= teacher_vocab_size
        ):
            raise ValueError(
                f"the VocabMap has ids up to student {int(self.student_ids.max())} / teacher "
                f"{int(self.teacher_ids.max())} but the lm_heads have {student_vocab_size} / {teacher_vocab_size} "
                f"rows; build it from these models' tokenizers (VocabMap.build(..., student_vocab_size=..., ...))"
            )


def byte_level_to_text(token: str) -> str:
    """GPT-2 ByteLevel and SentencePiece token strings as the text they stand for ("Ġthe", "▁the" -> " the");
    a byte-level piece of a multi-byte character stays as it is (it matches nothing)."""
    table = _byte_decoder()
    if all(ch in table for ch in token):
        try:
            return bytes(table[ch] for ch in token).decode("utf-8")
        except UnicodeDecodeError:
            return token
    return token.replace("▁", " ")


@functools.cache  # read once per token string when a VocabMap is built: build the table once
def _byte_decoder() -> dict[str, int]:
    """GPT-2's reversible bytes <-> printable characters table, inverted (shared: callers only read it)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes)}


def is_byte_level(tokenizer) -> bool:
    """Whether a tokenizer's token strings are GPT-2 byte-level ("Ġthe"), from its serialised pipeline."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    return hasattr(backend, "to_str") and '"ByteLevel"' in backend.to_str()


def special_ids_of(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "unk_token_id"):
        if isinstance(getattr(tokenizer, name, None), int):
            ids.add(getattr(tokenizer, name))
    if hasattr(tokenizer, "get_added_tokens_decoder"):
        ids |= {i for i, t in tokenizer.get_added_tokens_decoder().items() if getattr(t, "special", False)}
    return ids


def token_text_bytes(token: str, byte_level: bool) -> bytes:
    """The UTF-8 bytes of the text a token string stands for (b"" when it stands for none)."""
    if byte_level:
        table = _byte_decoder()
        return bytes(table[ch] for ch in token) if all(ch in table for ch in token) else b""
    if token.startswith("<0x") and token.endswith(">") and len(token) == 6:  # SentencePiece byte fallback
        return bytes([int(token[3:5], 16)])
    return token.replace("▁", " ").encode("utf-8")


def token_first_byte(token: str, byte_level: bool) -> int:
    """The first UTF-8 byte of the text a token string stands for (NO_BYTE when it stands for none)."""
    data = token_text_bytes(token, byte_level)
    return data[0] if data else NO_BYTE


def token_texts(tokenizer_or_vocab, size: int, byte_level: bool | None = None) -> list[bytes]:
    """The text (UTF-8 bytes) of each id below `size`; b"" for special tokens and ids without a token."""
    is_dict = isinstance(tokenizer_or_vocab, Mapping)
    vocab = tokenizer_or_vocab if is_dict else vocabulary_of(tokenizer_or_vocab)
    level = byte_level if byte_level is not None else (False if is_dict else is_byte_level(tokenizer_or_vocab))
    special = set() if is_dict else special_ids_of(tokenizer_or_vocab)
    texts = [b""] * size
    for token, i in vocab.items():
        if i < size and i not in special:
            texts[i] = token_text_bytes(token, level)
    return texts


def first_byte_classes(tokenizer_or_vocab, size: int, byte_level: bool | None = None) -> torch.Tensor:
    """(size,) first byte of each id's token (NO_BYTE for special tokens and ids without a token)."""
    return first_bytes(token_texts(tokenizer_or_vocab, size, byte_level))


def first_bytes(texts: list[bytes]) -> torch.Tensor:
    return torch.tensor([t[0] if t else NO_BYTE for t in texts], dtype=torch.long)


def project_to_bytes(probs: torch.Tensor, first_byte: torch.Tensor | None) -> torch.Tensor:
    """(rows, NO_BYTE + 1): each id's probability added to its first byte's class (`VocabMap.*_first_byte`);
    ids with no byte (special tokens) go to the NO_BYTE class. Shared by the fused loss and its reference."""
    if first_byte is None or first_byte.numel() != probs.shape[-1]:
        raise ValueError(
            f"kind='next_byte' needs a VocabMap with first-byte classes for all {probs.shape[-1]} ids; build it "
            f"with VocabMap.build(student_tokenizer, teacher_tokenizer, ...)"
        )
    return torch.zeros(probs.shape[0], NO_BYTE + 1, dtype=probs.dtype, device=probs.device).index_add(
        1, first_byte.to(probs.device), probs
    )
