"""`liger-kd demo`: distillation from nothing, on whatever machine this is.

1. the fused loss against materialised logits on one toy batch: same value, a fraction of the memory;
2. a small teacher trained on the packaged corpus (character tokenizer, no downloads);
3. one smaller student per recipe, same init, same steps: CE only, online fused JSD, offline top-k from a
   store precomputed here, on-policy (GKD): student-generated completions as long as the data's windows, after a
   warm-up of off-policy steps (kd_onpolicy_warmup_steps, the way GKD starts from a fine-tuned student);
4. a table: held-out CE, KL(teacher || student) per token on held-out text and on sampled text (every student's
   samples pooled: one set of contexts for all, demo/samples.py), the teacher's NLL of each student's own
   samples, tokens/s, peak memory;
5. a task with a right answer (demo.arithmetic_students): small arithmetic problems, a teacher that knows them, and
   a student given worked solutions for a few of them and the prompts of all, trained from one start by SFT on
   the labelled problems (for as many steps, and for as many seconds as on-policy KD) and by on-policy KD on every
   prompt; each one's exact-match accuracy on held-out problems beside the teacher's;
6. across tokenizers (demo.cross_tokenizer): a student with its own byte-level BPE tokenizer, on 10 % of the training
   text, on CE only and on CE + byte-chain KD from the same character teacher (held-out nats/char).

The default is the short run (`quick`: smaller sizes, one seed); `--full` the
three-seed table at full sizes.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import reference
from ..losses import fused_linear_jsd
from ..models import revert_kd_patch
from ..utils.memory import PeakMemory, peak_memory_meaning
from .arithmetic_students import ArithmeticDemoSizes, run_arithmetic_students
from .samples import sample_continuations, score_on_samples, teacher_nll
from .toys import (
    PAD,
    CharTokenizer,
    DemoSizes,
    build_model,
    demo_threads,
    load_corpus,
    quiet,
    training_args,
    windows,
)

ONPOLICY_RECIPE = "on-policy (GKD, warm-up)"


def onpolicy_kd(sizes: DemoSizes) -> dict:
    """The on-policy row's options. Off-policy (online KD) for the first half of the steps, then kd_lmbda 0.5:
    from a random init the student's samples are noise, which teaches it nothing (GKD starts from a fine-tuned
    student). Each completion is seq - 1 characters after BOS, as long as a data window: the row trains on as many
    tokens, at as many positions, as the others (24 characters trained on 69 % of their tokens, never past
    position 24)."""
    return dict(use_kd_patch=True, kd_beta=0.0, kd_lmbda=0.5, kd_onpolicy_warmup_steps=0.5,
                kd_max_new_tokens=sizes.seq - 1)  # fmt: skip


@torch.no_grad()
def evaluate(student, teacher, windows: list[list[int]], device) -> tuple[float, float]:
    """Held-out next-token CE of the student and KL(teacher || student) per token."""
    student.eval()
    ids = torch.tensor(windows, device=device)
    labels = F.pad(ids[:, 1:], (0, 1), value=-100)
    s = student(input_ids=ids).logits.float()
    t = teacher(input_ids=ids).logits.float()
    ce = reference.cross_entropy_per_row(s, labels)[labels != -100].mean()
    kl = reference.generalized_jsd(s, t, labels, beta=0.0)
    return float(ce), float(kl)


def loss_memory_demo(device, heading: str = "[1/6] the loss alone") -> None:
    """Step 1 (and `liger-kd bench`, under its own `heading`): one batch of the fused loss against the loss on
    materialised logits."""
    n, hidden, vocab = (1024, 128, 32000) if device.type == "cpu" else (8192, 2048, 128256)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    h_s = torch.randn(n, hidden, device=device, dtype=dtype, requires_grad=True)
    w_s = (torch.randn(vocab, hidden, device=device) / hidden**0.5).to(dtype).requires_grad_()
    h_t = torch.randn(n, hidden, device=device, dtype=dtype)
    w_t = (torch.randn(vocab, hidden, device=device) / hidden**0.5).to(dtype)
    labels = torch.randint(0, vocab, (n,), device=device)

    def step(name: str) -> torch.Tensor:
        if name.startswith("fused"):
            loss = fused_linear_jsd(h_s, w_s, h_t, w_t, labels)
        else:
            loss = reference.kd_loss((h_s @ w_s.T).float(), (h_t @ w_t.T).float(), labels)
        loss.backward()
        return loss

    shape = f"N={n} tokens, H={hidden}, V={vocab}, {str(dtype).split('.')[-1]}"
    print(f"\n{heading}: {shape}, forward+backward, fused against materialised logits", flush=True)
    rows = []
    for name in ("fused (liger_patch_kd)", "materialised logits"):
        try:
            if device.type != "cpu":  # warm-up: Triton compiles its kernels on the first call, cuBLAS picks algorithms
                step(name)
                h_s.grad = w_s.grad = None
            with PeakMemory(device) as mem:
                start = time.perf_counter()
                loss = step(name)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - start
            rows.append((name, f"{loss.item():12.6f}{mem.peak_mib:12.1f}{seconds * 1000:10.1f}"))
        except torch.OutOfMemoryError:  # the materialised logits on a small GPU: that is the finding, not a crash
            rows.append((name, f"{'out of memory on ' + device.type:>34}"))
            if device.type == "cuda":
                torch.cuda.empty_cache()
        h_s.grad = w_s.grad = None
    print(f"{'':24}{'loss':>12}{'peak MiB':>12}{'ms':>10}")
    for name, cells in rows:
        print(f"{name:24}{cells}")
    print(f"  {peak_memory_meaning(device)}")


def _mean_spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _figure(values: list[float], digits: int, width: int) -> str:
    """`mean ± spread` over the seeds (the mean alone for one seed), right-aligned in `width`."""
    mean, spread = _mean_spread(values)
    text = f"{mean:.{digits}f}" + (f" ± {spread:.{digits}f}" if len(values) > 1 else "")
    return f"{text:>{width}}"


def run_demo(
    quick: bool = True, device: str | None = None, cross_tokenizer: bool | None = None,
    seeds: tuple[int, ...] | None = None, arithmetic: bool | ArithmeticDemoSizes = True,
) -> list[dict]:  # fmt: skip
    """The rows of step 4, then step 5's (with `arithmetic`: True for ArithmeticDemoSizes(), or the sizes to use;
    False skips it): {"recipe", "exact_match": the mean over seeds, "exact_match_by_seed", "seconds_by_seed"
    (training), "teacher_exact_match", "start_exact_match_by_seed", "held_out": how many problems, "arithmetic":
    True}, then (with `cross_tokenizer`; None: in the full run only) step 6's: {"recipe": "BPE student: ...",
    "held_out_ce": nats/char (mean over inits), "held_out_ce_by_seed", "cross_tokenizer": True}.

    `quick` (the default, as `liger-kd demo`'s): DemoSizes.quick() and one seed; False: full sizes, three seeds.
    Each student recipe is trained from `seeds` (seed s: student init s, data order s - 1; default 1, 2, 3, or 1
    under `quick`) against the one teacher; a step-4 row holds the means (held_out_ce, kl_to_teacher, kl_samples,
    teacher_nll, tokens_per_s, peak_mib) and every seed's values (`<name>_by_seed`). The table prints mean ±
    standard deviation over the seeds: float32 results differ between CPUs (BLAS kernels, thread counts), and such
    differences move the figures by about that spread. On a CPU it runs on one thread unless OMP_NUM_THREADS is set
    (toys.demo_threads). Everything is written to a temporary folder, removed at the end."""
    if not isinstance(arithmetic, (bool, ArithmeticDemoSizes)):
        raise ValueError(f"run_demo(arithmetic={arithmetic!r}): give True (the default sizes), False (skip the "
                         f"arithmetic step) or an ArithmeticDemoSizes")  # fmt: skip
    sizes = ArithmeticDemoSizes() if arithmetic is True else arithmetic or None
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with tempfile.TemporaryDirectory(prefix="liger_kd_demo_") as work, demo_threads(dev):
        return _run_demo(Path(work), quick, dev, not quick if cross_tokenizer is None else cross_tokenizer, seeds,
                         sizes)  # fmt: skip


def demo_data(sizes: DemoSizes):
    """(tokenizer, training windows, 64 held-out windows, the training dataset, its collator) of the corpus."""
    from ..teacher import TeacherDataCollator

    text = load_corpus()
    tok = CharTokenizer(text)
    split = int(len(text) * 0.9)
    train = windows(tok.encode(text[:split]), sizes.seq)
    held_out = windows(tok.encode(text[split:]), sizes.seq)[:64]
    dataset = [{"input_ids": torch.tensor(w)} for w in train]
    return tok, train, held_out, dataset, TeacherDataCollator(pad_token_id=PAD)


def train_teacher(dataset, collator, vocab: int, sizes: DemoSizes, out: Path, device):
    """Step 2: the demo's teacher, Llama 4 x 128, trained on `dataset` with CE for sizes.teacher_steps."""
    from transformers import Trainer

    teacher = build_model(vocab, 128, 4, seed=0, device=device)
    quiet(Trainer(model=teacher, args=training_args(out, sizes.teacher_steps, sizes.batch, device),
                  train_dataset=dataset, data_collator=collator)).train()  # fmt: skip
    return teacher.eval()


def _train_student(recipe: dict | None, seed: int, vocab: int, sizes: DemoSizes, dataset, collator, out: Path, dev):
    """One student of step 3: (the model, unpatched again, {"tokens_per_s", "peak_mib", "seconds"})."""
    from transformers import Trainer

    from ..trainer import KDTrainer

    student = build_model(vocab, 64, 2, seed=seed, device=dev)
    # seed s: student init s, data order (and on-policy sampling) s - 1, so seed 1 is 0.2's one configuration
    args = training_args(out, sizes.student_steps, sizes.batch, dev, seed=seed - 1, **(recipe or {}).get("kd", {}))
    if recipe is None:
        trainer = Trainer(model=student, args=args, train_dataset=dataset, data_collator=collator)
    else:
        trainer = KDTrainer(model=student, teacher_model=recipe["teacher"], args=args, train_dataset=recipe["data"],
                            data_collator=collator)  # fmt: skip
    with PeakMemory(dev) as mem:
        start = time.perf_counter()
        quiet(trainer).train()
        seconds = time.perf_counter() - start
    revert_kd_patch(model=student)
    tokens = sizes.student_steps * sizes.batch * sizes.seq
    return student.eval(), dict(tokens_per_s=tokens / seconds, peak_mib=mem.peak_mib, seconds=seconds)


def _run_demo(work: Path, quick: bool, dev: torch.device, cross_tokenizer: bool, seeds,
              arithmetic: ArithmeticDemoSizes | None) -> list[dict]:  # fmt: skip
    from .. import teacher as TD

    began = time.perf_counter()
    sizes = DemoSizes.quick() if quick else DemoSizes()
    seeds = tuple(seeds or ((1,) if quick else (1, 2, 3)))
    loss_memory_demo(dev)

    tok, train, held_out, dataset, collator = demo_data(sizes)
    vocab = len(tok)

    print(f"\n[2/6] teacher: Llama 4 x 128, {sizes.teacher_steps} steps on {len(train)} windows of {sizes.seq} "
          f"characters ({vocab} symbols) ...", flush=True)  # fmt: skip
    start = time.perf_counter()
    teacher = train_teacher(dataset, collator, vocab, sizes, work / "teacher", dev)
    ce, _ = evaluate(teacher, teacher, held_out, dev)
    print(f"  teacher held-out CE {ce:.3f} nats/char ({time.perf_counter() - start:.0f} s)")

    recipes_named = "CE only, online KD, offline top-k, on-policy"
    print(f"\n[3/6] students: Llama 2 x 64, {sizes.student_steps} steps each ({recipes_named}), seeds {list(seeds)} "
          f"(init, data order)", flush=True)  # fmt: skip
    store = TD.precompute(teacher, train, work / "store", top_k=sizes.top_k, batch_size=32,
                          tokenizer_fp=TD.tokenizer_fingerprint(tok), progress=False)  # fmt: skip
    offline_data = TD.TeacherLogprobsDataset(store, vocab_size=vocab, tokenizer=tok)
    recipes = {
        "CE only": None,
        # beta 0 (forward KL) in every KD recipe: the quantity the table reports, so the recipes compare fairly
        "online fused JSD (beta 0)": dict(teacher=teacher, data=dataset, kd=dict(use_kd_patch=True, kd_beta=0.0)),
        f"offline top-{sizes.top_k} (store)": dict(
            teacher=None, data=offline_data, kd=dict(use_kd_patch=True, kd_beta=0.0)
        ),
        ONPOLICY_RECIPE: dict(teacher=teacher, data=dataset, kd=onpolicy_kd(sizes)),
    }
    runs: dict[str, list[dict]] = {name: [] for name in recipes}
    for seed in seeds:
        students = {}
        for name, recipe in recipes.items():
            students[name], run = _train_student(recipe, seed, vocab, sizes, dataset, collator, work / "student", dev)
            run["held_out_ce"], run["kl_to_teacher"] = evaluate(students[name], teacher, held_out, dev)
            runs[name].append(run)
            print(f"  {name}, seed {seed}: held-out CE {run['held_out_ce']:.3f}, KL {run['kl_to_teacher']:.4f} "
                  f"({run['seconds']:.0f} s)", flush=True)  # fmt: skip
        # every student scored on every student's samples of the held-out prompts: one set of contexts for all
        for name, scores in score_on_samples(students, teacher, held_out, dev, seed=seed - 1).items():
            runs[name][-1].update(scores)
    results = []
    for name, by_seed in runs.items():
        row = dict(recipe=name, seeds=list(seeds))
        for key in ("held_out_ce", "kl_to_teacher", "kl_samples", "teacher_nll", "tokens_per_s", "peak_mib"):
            row[f"{key}_by_seed"] = [r[key] for r in by_seed]
            row[key] = _mean_spread(row[f"{key}_by_seed"])[0]
        results.append(row)
    teacher_own = teacher_nll(teacher, sample_continuations(teacher, held_out, dev))
    _print_table(results, seeds, dev, teacher_own, time.perf_counter() - began)
    assert all(math.isfinite(r["kl_to_teacher"]) for r in results)
    if arithmetic is not None:
        results += _arithmetic_rows(arithmetic, seeds, work / "arithmetic", dev, began)
    else:
        print("\n[5/6] a task with a right answer: skipped")
    if cross_tokenizer:
        results += _cross_tokenizer_rows(teacher, quick, dev)
    else:
        print("\n[6/6] across tokenizers (a student with its own BPE tokenizer): `liger-kd demo --full` runs it, or "
              "alone: python -m liger_patch_kd.demo.cross_tokenizer --quick")  # fmt: skip
    return results


def _print_table(results: list[dict], seeds, dev, teacher_own: float, seconds: float) -> None:
    spread = f"mean ± standard deviation over student seeds {list(seeds)}" if len(seeds) > 1 else f"seed {seeds[0]}"
    print(f"\n[4/6] the students ({spread}; {seconds:.0f} s so far)")
    print("  CE: held-out nats/char. KL text: KL(teacher || student) per token on held-out text. KL samples: the same "
          "on\n  sampled text, every student's continuations of the held-out prompts pooled (one set of contexts for "
          f"all).\n  teacher NLL: the teacher's nats per token of the student's own samples (of its own: "
          f"{teacher_own:.3f}). tokens/s: training tokens per second.\n  {peak_memory_meaning(dev)}.")  # fmt: skip
    w = 16 if len(seeds) > 1 else 12
    header = "".join(f"{label:>{w}}" for label in ("CE", "KL text", "KL samples", "teacher NLL"))
    print(f"{'recipe':28}{header}{'tokens/s':>10}{'peak MiB':>10}")
    for r in results:
        cells = [_figure(r[f"{key}_by_seed"], digits, w) for key, digits in (
            ("held_out_ce", 3), ("kl_to_teacher", 4), ("kl_samples", 4), ("teacher_nll", 3))]  # fmt: skip
        print(f"{r['recipe']:28}{''.join(cells)}{r['tokens_per_s']:10.0f}{r['peak_mib']:10.1f}")


def _arithmetic_rows(sizes: ArithmeticDemoSizes, seeds, out: Path, dev, began: float) -> list[dict]:
    """Step 5: arithmetic_students' run for the demo's student seeds, printed as a second table."""
    print("\n[5/6] a task with a right answer, few solutions, many prompts: exact match on held-out arithmetic "
          "problems (greedy decoding)", flush=True)  # fmt: skip
    run = run_arithmetic_students(sizes, seeds, out, dev)
    rows = [dict(recipe=r["recipe"], exact_match=_mean_spread(r["exact_match_by_seed"])[0],
                 exact_match_by_seed=r["exact_match_by_seed"], seconds_by_seed=r["seconds_by_seed"],
                 steps_by_seed=r["steps_by_seed"], teacher_exact_match=run["teacher_accuracy"],
                 start_exact_match_by_seed=run["start_accuracy_by_seed"], held_out=run["held_out"],
                 labelled=run["labelled"], arithmetic=True) for r in run["rows"]]  # fmt: skip
    w = 16 if len(seeds) > 1 else 12
    print(f"\n  exact match: the fraction of {run['held_out']} held-out problems whose greedy answer is right; teacher "
          f"{run['teacher_accuracy']:.3f}, the students' shared start (after {sizes.format_steps} format steps) "
          f"{_figure(run['start_accuracy_by_seed'], 3, 0)}.\n  labelled: the {run['labelled']} problems with a worked "
          f"solution; all prompts: the {run['train_problems']} training prompts, no solutions needed (the student "
          f"writes,\n  the teacher grades every token). train s: training seconds (the KD rows run the teacher too, "
          f"the on-policy row generates);\n  the last row is SFT given the on-policy row's seconds. "
          f"{time.perf_counter() - began:.0f} s so far")  # fmt: skip
    print(f"{'recipe':36}{'exact match':>{w}}{'steps':>8}{'train s':>10}")
    for r in rows:
        seconds, steps = _mean_spread(r["seconds_by_seed"])[0], _mean_spread(r["steps_by_seed"])[0]
        print(f"{r['recipe']:36}{_figure(r['exact_match_by_seed'], 3, w)}{steps:8.0f}{seconds:10.1f}")
    return rows


def _cross_tokenizer_rows(teacher, quick: bool, device) -> list[dict]:
    """Step 6 on the demo's teacher (trained on the same 90 % of the corpus): cross_tokenizer.py's quick sizes, one
    student init under --quick."""
    from .cross_tokenizer import QUICK_RECIPES, CrossTokenizerDemoSizes, run_cross_tokenizer_demo

    sizes = CrossTokenizerDemoSizes.quick()
    print("\n[6/6] across tokenizers: the same teacher into a student with its own byte-level BPE tokenizer")
    out = run_cross_tokenizer_demo(teacher, device=str(device), recipes=QUICK_RECIPES,
                                   sizes=replace(sizes, seeds=(1,)) if quick else sizes)  # fmt: skip
    return [dict(recipe=f"BPE student: {name}", held_out_ce=r["ce_per_char"],
                 held_out_ce_by_seed=r["ce_per_char_by_seed"], cross_tokenizer=True)
            for name, r in out["recipes"].items()]  # fmt: skip
