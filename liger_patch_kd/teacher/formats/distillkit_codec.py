"""DistillKit's compressed rows (arcee-ai/DistillKit, `DistributionQuantizationConfig`): its compressor settings,
validated, and the byte rows of one position decoded and encoded. distillkit.py reads and writes the files.

Per position, with b = ceil(log2(d)) (DistillKit computes it in float32) and m = k - exact_k:
- bytepacked_indices: k ids of b bits each, most significant bit first, concatenated, zero-padded to a byte.
- compressed_logprobs, in order: exact_k floats (exact_dtype); one coefficient per polynomial term (term_dtype);
  per residual bin a scale (scale_dtype) and num_elements codes of element_bits bits, packed like the ids.
  Floats are little-endian. Tail slot t (0 .. m - 1) is sum_j c_j * basis_j(x_t) + residual_t, x_t = t or
  linspace(0, 1, m)[t] (normalize_t), basis "int p" = x**p, "sqrt", "exp"; the fit is evaluated in term_dtype
  (as DistillKit's reader does: the writer took the residuals against that). A residual code q decodes to
  (q - 2**(bits - 1)) * scale, or (2q - 1) * scale for 1-bit bins; slots past the bins have residual 0.
- delta_encoding: the k decoded values are differences (the first is the value): log-probs are their cumsum.
Decoding here is in float64 (DistillKit's reader rounds the result to exact_dtype; this keeps the extra bits).
`error_diffusion` changes only how a writer rounds; the reader is the same. `pyyaml` is imported lazily.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..store import TeacherStoreError

CONFIG_FILE = "compression_config.yaml"
_FLOAT_WIDTH = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
_TORCH_DTYPE = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                "float64": torch.float64}  # fmt: skip
_NUMPY_DTYPE = {"float16": "<f2", "float32": "<f4", "float64": "<f8"}  # bfloat16: by hand (numpy has none)
_SPECIAL_TERMS = {"sqrt": torch.sqrt, "exp": torch.exp}
# DistillKit's defaults for keys a hand-written config may leave out (its pydantic model's).
_DEFAULTS = {"exact_dtype": "float32", "polynomial_terms": None, "term_dtype": "float32", "delta_encoding": True,
             "error_diffusion": False, "normalize_t": False}  # fmt: skip
_REQUIRED = ("d", "k", "exact_k", "residual_bins")
_LEGACY_KEYS = {"vocab_size", "polynomial_degree", "invert_polynomial", "with_sqrt_term"}


@dataclass(frozen=True)
class ResidualBin:
    scale_dtype: str
    element_bits: int
    num_elements: int

    @property
    def nbytes(self) -> int:
        return _FLOAT_WIDTH[self.scale_dtype] + (self.num_elements * self.element_bits + 7) // 8


@dataclass(frozen=True)
class CompressorConfig:
    """DistillKit's compressor settings, validated; `from_any` reads a dict, a .yaml / .json file or a folder."""

    d: int
    k: int
    exact_k: int
    residual_bins: tuple[ResidualBin, ...]
    exact_dtype: str = "float32"
    polynomial_terms: tuple[int | str, ...] = ()
    term_dtype: str = "float32"
    delta_encoding: bool = True
    error_diffusion: bool = False
    normalize_t: bool = False

    @classmethod
    def from_any(cls, source: dict | str | Path | CompressorConfig) -> CompressorConfig:
        if isinstance(source, CompressorConfig):
            return source
        if not isinstance(source, dict):
            source = read_config_file(Path(source))
        return cls.from_dict(source)

    @classmethod
    def from_dict(cls, raw: dict) -> CompressorConfig:
        """Settings from a parsed config; every value's type is checked (ints are ints, bools are bools: `d: 64.9`
        or `delta_encoding: "no"` is a ValueError naming the key, never read as 64 or True)."""
        if not isinstance(raw, dict):
            raise ValueError(f"compressor settings must be a mapping of keys ({list(_REQUIRED)}, ...); got "
                             f"{type(raw).__name__} {str(raw)[:60]!r}: is this the compression_config.yaml?"
                             )  # fmt: skip
        if _LEGACY_KEYS & set(raw):
            raise ValueError(
                f"compressor settings {sorted(_LEGACY_KEYS & set(raw))} are DistillKit's legacy_logit_compression; "
                f"only the logprob_compressor format (compressed_logprobs + bytepacked_indices) is supported"
            )
        unknown = set(raw) - set(_REQUIRED) - set(_DEFAULTS)
        missing = [key for key in _REQUIRED if key not in raw]
        if unknown or missing:
            raise ValueError(
                f"compressor settings: unknown keys {sorted(map(str, unknown))}, missing keys {missing}; expected "
                f"{list(_REQUIRED)} and optionally {sorted(_DEFAULTS)} (the compression_config.yaml of the capture)"
            )
        cfg = {**_DEFAULTS, **raw}
        for key in ("exact_dtype", "term_dtype"):
            _check_dtype(cfg[key], key)
        for key in ("delta_encoding", "error_diffusion", "normalize_t"):
            if not isinstance(cfg[key], bool):
                raise ValueError(f"compressor setting {key} = {cfg[key]!r} must be true or false (a YAML bool)")
        d, k, exact_k = (_int(cfg[key], key) for key in ("d", "k", "exact_k"))
        if cfg["residual_bins"] is not None and not isinstance(cfg["residual_bins"], list):
            raise ValueError(f"compressor setting residual_bins = {repr(cfg['residual_bins'])[:60]} must be a list "
                             f"of {{scale_dtype, element_bits, num_elements}}")  # fmt: skip
        bins = []
        for n, b in enumerate(cfg["residual_bins"] or []):
            if not isinstance(b, dict) or set(b) != {"scale_dtype", "element_bits", "num_elements"}:
                raise ValueError(f"residual_bins[{n}] = {str(b)[:60]}; expected keys scale_dtype, element_bits, "
                                 f"num_elements")  # fmt: skip
            _check_dtype(b["scale_dtype"], f"residual_bins[{n}].scale_dtype")
            bits = _int(b["element_bits"], f"residual_bins[{n}].element_bits")
            count = _int(b["num_elements"], f"residual_bins[{n}].num_elements")
            if not (1 <= bits <= 64 and count >= 1):
                raise ValueError(f"residual_bins[{n}]: element_bits must be in [1, 64] and num_elements >= 1; got {b}")
            bins.append(ResidualBin(b["scale_dtype"], bits, count))
        if cfg["polynomial_terms"] is not None and not isinstance(cfg["polynomial_terms"], list):
            raise ValueError(f"compressor setting polynomial_terms = {repr(cfg['polynomial_terms'])[:60]} must be a "
                             f"list (of powers and 'sqrt' / 'exp') or null")  # fmt: skip
        terms = []
        for term in cfg["polynomial_terms"] or []:
            if isinstance(term, str) and term in _SPECIAL_TERMS:
                terms.append(term)
            elif isinstance(term, int) and not isinstance(term, bool) and term >= 0:
                terms.append(term)
            else:
                raise ValueError(f"polynomial term {term!r} is not a power >= 0 nor one of {sorted(_SPECIAL_TERMS)}")
        tail = k - exact_k
        if not 2 <= d < 2**31 or k < 1 or not 0 <= exact_k <= k or sum(b.num_elements for b in bins) > tail:
            raise ValueError(
                f"compressor settings need 2 <= d < 2**31, 1 <= k, 0 <= exact_k <= k and residual bins holding at "
                f"most k - exact_k elements; got d={d}, k={k}, exact_k={exact_k}, bins={bins}"
            )
        if tail and not terms and not bins:
            raise ValueError(f"exact_k {exact_k} < k {k} with no polynomial_terms and no residual_bins: the tail "
                             f"would carry no information (DistillKit refuses this config too)")  # fmt: skip
        return cls(d=d, k=k, exact_k=exact_k, residual_bins=tuple(bins), exact_dtype=cfg["exact_dtype"],
                   polynomial_terms=tuple(terms), term_dtype=cfg["term_dtype"],
                   delta_encoding=cfg["delta_encoding"], error_diffusion=cfg["error_diffusion"],
                   normalize_t=cfg["normalize_t"])  # fmt: skip

    def to_dict(self) -> dict:
        """Every key, as DistillKit's capture writes compression_config.yaml."""
        return {"d": self.d, "k": self.k, "exact_k": self.exact_k, "exact_dtype": self.exact_dtype,
                "polynomial_terms": list(self.polynomial_terms) or None, "term_dtype": self.term_dtype,
                "residual_bins": [vars(b).copy() for b in self.residual_bins], "delta_encoding": self.delta_encoding,
                "error_diffusion": self.error_diffusion, "normalize_t": self.normalize_t}  # fmt: skip

    @property
    def index_bits(self) -> int:
        # DistillKit's definition: ceil(log2(d)) in float32 (differs from exact for some d > 2**21).
        return int(torch.log2(torch.tensor(float(self.d), dtype=torch.float32)).ceil().item())

    @property
    def index_bytes(self) -> int:
        return (self.k * self.index_bits + 7) // 8

    @property
    def logprob_bytes(self) -> int:
        return (self.exact_k * _FLOAT_WIDTH[self.exact_dtype]
                + len(self.polynomial_terms) * _FLOAT_WIDTH[self.term_dtype]
                + sum(b.nbytes for b in self.residual_bins))  # fmt: skip

    def basis(self) -> torch.Tensor:
        """(m, terms) basis of the tail fit, in term_dtype as DistillKit's reader builds it."""
        m, dtype = self.k - self.exact_k, _TORCH_DTYPE[self.term_dtype]
        x = torch.linspace(0, 1, steps=m, dtype=dtype) if self.normalize_t else torch.arange(m, dtype=dtype)
        cols = [_SPECIAL_TERMS[t](x) if isinstance(t, str) else x**t for t in self.polynomial_terms]
        return torch.stack(cols, dim=-1)


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"compressor setting {what} = {value!r} must be an integer (got {type(value).__name__})")
    return value


def _check_dtype(name: Any, what: str) -> None:
    if not isinstance(name, str) or name not in _FLOAT_WIDTH:
        raise ValueError(f"compressor setting {what} = {name!r}; expected one of {sorted(_FLOAT_WIDTH)}")


def read_config_file(path: Path) -> dict:
    """Compressor settings from a .yaml / .json file, or a folder's compression_config.yaml."""
    if path.is_dir():
        path = path / CONFIG_FILE
    if not path.exists():
        raise ValueError(f"{path}: no compressor settings there; pass the compression_config.yaml the data was "
                         f"written with (--compressor)")  # fmt: skip
    text = path.read_text()
    if path.suffix == ".json":
        errors: tuple[type[BaseException], ...] = (ValueError,)
        parse = json.loads
    else:
        import yaml

        errors, parse = (yaml.YAMLError, ValueError), yaml.safe_load
    try:
        return parse(text)
    except errors as e:  # one line naming the file, not the parser's traceback
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{path}: the compressor settings do not parse ({first}); pass the compression_config.yaml "
                         f"the data was written with") from None


# ------------------------------------------------------------------------------------------------- bit fields
def unpack_fields(rows: np.ndarray, bits: int, count: int) -> np.ndarray:
    """(P, bytes) uint8 -> (P, count) uint64: `count` fields of `bits` bits, most significant bit first."""
    stream = np.unpackbits(rows, axis=-1)[:, : bits * count].reshape(len(rows), count, bits)
    weights = np.left_shift(np.uint64(1), np.arange(bits - 1, -1, -1, dtype=np.uint64))
    return (stream.astype(np.uint64) * weights).sum(-1, dtype=np.uint64)


def pack_fields(values: np.ndarray, bits: int) -> np.ndarray:
    """(P, count) non-negative ints -> (P, ceil(count * bits / 8)) uint8, the inverse of `unpack_fields`."""
    shifts = np.arange(bits - 1, -1, -1, dtype=np.uint64)
    stream = (values.astype(np.uint64)[..., None] >> shifts) & np.uint64(1)
    return np.packbits(stream.reshape(len(values), -1).astype(np.uint8), axis=-1)


def _floats(raw: np.ndarray, dtype: str) -> np.ndarray:
    """(P, n * width) little-endian bytes -> (P, n) float64."""
    if dtype == "bfloat16":  # a bf16 is the high half of a float32
        halves = np.ascontiguousarray(raw).view("<u2").astype(np.uint32) << 16
        return halves.view(np.float32).astype(np.float64)
    return np.ascontiguousarray(raw).view(_NUMPY_DTYPE[dtype]).astype(np.float64)


def _float_bytes(values: np.ndarray, dtype: str) -> np.ndarray:
    """(P, n) float64 -> (P, n * width) little-endian bytes, rounded to nearest even in `dtype`."""
    if dtype == "bfloat16":
        bits = torch.from_numpy(np.ascontiguousarray(values)).to(torch.bfloat16).view(torch.int16).numpy()
        return bits.astype("<i2").view(np.uint8).reshape(len(values), -1)
    out = values.astype(_NUMPY_DTYPE[dtype])
    return np.ascontiguousarray(out).view(np.uint8).reshape(len(values), -1)


def _tail_fit(cfg: CompressorConfig, coeffs: np.ndarray) -> np.ndarray:
    """(P, terms) coefficients -> (P, m) fitted tail, evaluated in term_dtype like DistillKit's reader."""
    c = torch.from_numpy(coeffs).to(_TORCH_DTYPE[cfg.term_dtype])
    return (cfg.basis().unsqueeze(0) * c.unsqueeze(-2)).sum(-1).double().numpy()


# ------------------------------------------------------------------------------------------------- decoding
def check_widths(cfg: CompressorConfig, logprob_rows: np.ndarray, index_rows: np.ndarray, where: str) -> None:
    """Byte rows as wide as these settings write, or a TeacherStoreError saying the settings are not the data's."""
    for name, rows, want in (("compressed_logprobs", logprob_rows, cfg.logprob_bytes),
                             ("bytepacked_indices", index_rows, cfg.index_bytes)):  # fmt: skip
        if rows.ndim != 2 or rows.shape[1] != want:
            raise TeacherStoreError(
                f"{where}: {name} rows are {rows.shape[1] if rows.ndim == 2 else 'ragged'} bytes; these compressor "
                f"settings (d={cfg.d}, k={cfg.k}, exact_k={cfg.exact_k}, ...) write {want}: the settings are not the "
                f"ones the data was written with"
            )


def decode_rows(cfg: CompressorConfig, logprob_rows: np.ndarray, index_rows: np.ndarray, where: str = "rows"):
    """(P, logprob_bytes), (P, index_bytes) uint8 -> ids (P, k) int64 and log-probs (P, k) float64."""
    check_widths(cfg, logprob_rows, index_rows, where)
    ids = unpack_fields(index_rows, cfg.index_bits, cfg.k).astype(np.int64)
    values = np.zeros((len(logprob_rows), cfg.k))
    at = cfg.exact_k * _FLOAT_WIDTH[cfg.exact_dtype]
    values[:, : cfg.exact_k] = _floats(logprob_rows[:, :at], cfg.exact_dtype)
    tail = values[:, cfg.exact_k :]
    if cfg.polynomial_terms:
        end = at + len(cfg.polynomial_terms) * _FLOAT_WIDTH[cfg.term_dtype]
        tail += _tail_fit(cfg, _floats(logprob_rows[:, at:end], cfg.term_dtype))
        at = end
    slot = 0
    for b in cfg.residual_bins:
        width = _FLOAT_WIDTH[b.scale_dtype]
        scale = _floats(logprob_rows[:, at : at + width], b.scale_dtype)
        codes = unpack_fields(logprob_rows[:, at + width : at + b.nbytes], b.element_bits, b.num_elements)
        levels = 2.0 * codes - 1.0 if b.element_bits == 1 else codes.astype(np.float64) - 2.0 ** (b.element_bits - 1)
        tail[:, slot : slot + b.num_elements] += levels * scale
        at, slot = at + b.nbytes, slot + b.num_elements
    if cfg.delta_encoding:
        values = np.cumsum(values, axis=-1)
    return ids, values


def check_decoded(cfg: CompressorConfig, values: np.ndarray, where: str) -> None:
    """Refuse a decode that cannot be the data: rows hold log-probs (each <= 0, top-k probabilities summing to at
    most 1) sorted most likely first, as every DistillKit writer stores them. Settings other than the ones the data
    was written with (e.g. delta_encoding false for delta-encoded data) decode to rows that break this."""
    with np.errstate(invalid="ignore", over="ignore"):
        reason = _impossible(cfg, values)
    if reason:
        raise TeacherStoreError(
            f"{where}: the rows decode to {reason}: these compressor settings (d={cfg.d}, k={cfg.k}, exact_k="
            f"{cfg.exact_k}, delta_encoding={cfg.delta_encoding}, ...) are not the ones the data was written with; "
            f"pass its compression_config.yaml"
        )


def _impossible(cfg: CompressorConfig, values: np.ndarray) -> str | None:
    finite = np.where(np.isfinite(values), values, -np.inf)
    reason = None
    if np.isnan(values).any() or np.isposinf(values).any():
        reason = "NaN or +inf (the writer fitted a row holding -inf, or the bytes are damaged)"
    elif (finite > _SLACK).any():
        reason = f"log-prob {finite[finite > _SLACK][0]:.4g} > 0"
    elif (np.logaddexp.reduce(finite, axis=-1) > np.log1p(0.05)).any():
        reason = "top-k probabilities summing to more than 1"
    else:
        exact = finite[:, : cfg.exact_k]
        rises = np.diff(exact, axis=-1) > 1e-6 if exact.shape[1] > 1 else np.zeros((len(finite), 0), bool)
        tail = finite[:, max(cfg.exact_k - 1, 0) :]
        span = np.ptp(np.where(np.isfinite(tail), tail, 0.0), axis=-1, keepdims=True) if tail.size else 0.0
        tail_rises = np.diff(tail, axis=-1) > 0.05 * span + 1e-3 if tail.shape[1] > 1 else rises[:, :0]
        if rises.any() or tail_rises.any():
            reason = "log-probs not in the stored, descending order"
    return reason


_SLACK = 1e-3  # rounding may leave a top log-prob a hair above 0


# ------------------------------------------------------------------------------------------------- encoding
def encode_rows(cfg: CompressorConfig, ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(P, k) ids and finite log-probs -> (compressed_logprobs, bytepacked_indices) byte rows.

    Least-squares tail fit (coefficients rounded to term_dtype, residuals taken against the fit as the reader
    evaluates it) and round-to-nearest residual codes with scale max|r| / 2**(bits - 1) (mean |r| for 1-bit
    bins, whose codes are signs). No error diffusion."""
    order = np.argsort(-values, axis=-1, kind="stable")  # the reader expects slots sorted, most likely first
    ids, v = np.take_along_axis(ids, order, -1), np.take_along_axis(values.astype(np.float64), order, -1)
    if cfg.delta_encoding:
        v = np.concatenate([v[:, :1], np.diff(v, axis=-1)], axis=-1)
    parts = [_float_bytes(v[:, : cfg.exact_k], cfg.exact_dtype)]
    residual = v[:, cfg.exact_k :]
    if cfg.polynomial_terms:
        basis = cfg.basis().double().numpy()
        coeffs = np.linalg.lstsq(basis, residual.T, rcond=None)[0].T
        stored = _float_bytes(coeffs, cfg.term_dtype)
        parts.append(stored)
        residual = residual - _tail_fit(cfg, _floats(stored, cfg.term_dtype))
    slot = 0
    for b in cfg.residual_bins:
        r = residual[:, slot : slot + b.num_elements]
        if b.element_bits == 1:
            scale = np.abs(r).mean(-1, keepdims=True)
        else:
            scale = np.abs(r).max(-1, keepdims=True) / 2.0 ** (b.element_bits - 1)
        scale_bytes = _float_bytes(np.where(scale > 0, scale, 1.0), b.scale_dtype)
        scale = _floats(scale_bytes, b.scale_dtype)
        if b.element_bits == 1:
            codes = (r >= 0).astype(np.uint64)
        else:
            half = 2.0 ** (b.element_bits - 1)
            codes = (np.clip(np.rint(r / scale), -half, half - 1) + half).astype(np.uint64)
        parts += [scale_bytes, pack_fields(codes, b.element_bits)]
        slot += b.num_elements
    return np.concatenate(parts, axis=-1), pack_fields(ids, cfg.index_bits)
