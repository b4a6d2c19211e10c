"""The arithmetic task (liger_patch_kd.demo.arithmetic) and the time-to-accuracy benchmark's pipeline at its smoke
size: the generator is deterministic and its answers right, the checker exact, the greedy scoring counts what it
should, and the benchmark writes its JSON. No learning outcome is asserted (those depend on the BLAS)."""

from __future__ import annotations

import importlib.util
import json
import re
import statistics

import pytest
import torch

from liger_patch_kd.demo.arithmetic import (
    ArithmeticTask,
    build_tokenizer,
    exact_match,
    final_answer,
    is_correct,
    split_task,
    tokenized,
)
from liger_patch_kd.demo.toys import EOS, PAD


def worked(problem) -> int:
    """The answer recomputed from the prompt alone, left to right."""
    tokens = re.findall(r"\d+|[+-]", problem.prompt)
    total = int(tokens[0])
    for sign, number in zip(tokens[1::2], tokens[2::2]):
        total = total + int(number) if sign == "+" else total - int(number)
    return total


def test_generator_is_deterministic_and_right():
    task = ArithmeticTask()
    first, again, other = task.problems(300, seed=7), task.problems(300, seed=7), task.problems(300, seed=8)
    assert first == again and first != other
    for p in first:
        assert p.answer == worked(p) >= 0
        steps = re.findall(r"(\d+)([+-])(\d+)=(\d+)", p.completion)
        assert len(steps) == task.operands - 1
        for a, sign, b, c in steps:  # every worked step is right, and each starts from the previous result
            assert int(c) == (int(a) + int(b) if sign == "+" else int(a) - int(b))
        assert all(int(steps[i + 1][0]) == int(steps[i][3]) for i in range(len(steps) - 1))
        assert final_answer(p.completion) == p.answer and is_correct(p.completion, p)


def test_held_out_is_disjoint_from_training():
    task = ArithmeticTask(held_out_every=10)
    train = {p.prompt for p in task.problems(2000, seed=0)}
    held_out = task.problems(200, seed=1, held_out=True)
    assert all(task.is_held_out(p) for p in held_out)
    assert not train & {p.prompt for p in held_out}


@pytest.mark.parametrize(
    "text, expected",
    [
        (" 37+48=85; 85-19=66. #### 66", 66),
        (" 37+48=85; 85-19=66. #### 66  ", 66),
        (" #### 0", 0),
        (" #### 12 #### 13", 13),  # the last one counts
        (" #### 066", None),  # a leading zero is not the number as written
        (" #### 66 apples", None),  # nothing may follow the answer
        (" #### -5", None),
        (" #### ", None),
        (" 37+48=85", None),
        ("#### 6.5", None),
    ],
)
def test_the_checker_is_exact(text, expected):
    assert final_answer(text) == expected


class ScriptedModel(torch.nn.Module):
    """A stand-in LM whose generate() writes a fixed completion per prompt (prompt ids -> completion ids), then
    padding: the scoring pipeline (batching, left padding, EOS, decoding, checking) without a trained model."""

    def __init__(self, script: dict[tuple[int, ...], list[int]]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.script = script
        self.calls = 0

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        self.calls += 1
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            new = self.script[tuple(i for i, m in zip(ids, mask) if m)][:max_new_tokens]
            rows.append(ids + new + [PAD] * (max_new_tokens - len(new)))
        return torch.tensor(rows)


def test_exact_match_scores_known_answers():
    task = ArithmeticTask()
    problems = task.problems(10, seed=3, held_out=True)
    tok = build_tokenizer(task.problems(500, seed=0))
    prompts, completions = tokenized(tok, problems)
    script = {}
    for i, (p, c, problem) in enumerate(zip(prompts, completions, problems)):
        if i % 2:  # every other answer off by one: wrong
            c = tok(problem.completion.replace(f"#### {problem.answer}", f"#### {problem.answer + 1}"),
                    add_special_tokens=False)["input_ids"] + [EOS]  # fmt: skip
        elif i == 4:  # text after EOS is not part of the completion
            c = c + tok(" 1", add_special_tokens=False)["input_ids"]
        script[tuple(p)] = c
    model = ScriptedModel(script)
    assert exact_match(model, tok, problems, batch_size=4) == 0.5
    assert model.calls == 3  # 10 prompts in batches of 4
    assert tok.decode(completions[0], skip_special_tokens=True) == problems[0].completion


def test_tokenizer_spells_digits_one_by_one():
    task = ArithmeticTask()
    tok = build_tokenizer(task.problems(500, seed=0))
    ids = tok(" 1234", add_special_tokens=False)["input_ids"]
    assert [tok.decode([i]) for i in ids] == [" ", "1", "2", "3", "4"]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)


def curve(*points):
    """A run of (seconds, accuracy) checkpoints, one step apart."""
    return {"curve": [dict(step=i, seconds=s, accuracy=a) for i, (s, a) in enumerate(points)]}


def test_offline_against_live_at_half_the_seconds():
    from benchmarks.common.accuracy import within_fraction_of_seconds

    live = [curve((0, 0.2), (10, 0.6), (20, 0.8)), curve((0, 0.2), (10, 0.5), (20, 0.6))]
    spread = 0.1 * 2**0.5  # the standard deviation of what training added: 0.6 and 0.4
    levels = [0.8 - spread, 0.6 - spread]  # each seed's own final, less the spread
    fast = [curve((0, 0.2), (2, 0.2), (4, 0.8)), curve((0, 0.2), (3, 0.2), (5, 0.8))]
    verdict = within_fraction_of_seconds(fast, live)
    # live seed 0 reaches its level between its last two checkpoints, seed 1 between its first two
    live_seconds = (10 + 10 * (levels[0] - 0.6) / 0.2 + 10 * (levels[1] - 0.2) / 0.3) / 2
    own_seconds = (2 + 2 * (levels[0] - 0.2) / 0.6 + 3 + 2 * (levels[1] - 0.2) / 0.6) / 2
    assert verdict["spread"] == pytest.approx(spread)
    assert verdict["levels"] == pytest.approx(levels)
    assert verdict["reference_seconds"] == pytest.approx(live_seconds)
    assert verdict["seconds"] == pytest.approx(own_seconds)
    assert verdict["answer"] is True and verdict["reached"] == "2/2" and verdict["text"].endswith("yes")
    slow = [curve((0, 0.2), (9, 0.2), (20, 0.8)), curve((0, 0.2), (9, 0.2), (20, 0.8))]
    assert within_fraction_of_seconds(slow, live)["answer"] is False
    short = [fast[0], curve((0, 0.2), (1, 0.3))]  # one seed never gets there: no, whatever the other's speed
    verdict = within_fraction_of_seconds(short, live)
    assert verdict["answer"] is False and verdict["reached"] == "1/2"
    started = [curve((0, 0.9), (10, 0.9))]  # the starting student already has it: nothing to compare
    assert within_fraction_of_seconds(fast, started)["answer"] is None
    assert within_fraction_of_seconds([], live)["answer"] is None


def test_offline_against_live_pairs_runs_by_seed():
    """Seeds start from different students: each candidate run is held to its own seed's reference run, and a seed
    whose reference never rose above its start is left out."""
    from benchmarks.common.accuracy import within_fraction_of_seconds

    def seeded(seed, *points):
        return {**curve(*points), "seed": seed}

    live = [seeded(1, (0, 0.1), (10, 0.3), (20, 0.5)), seeded(2, (0, 0.7), (10, 0.6), (20, 0.6)),
            seeded(3, (0, 0.1), (10, 0.3), (20, 0.5))]  # fmt: skip
    spread = statistics.stdev([0.4, -0.1, 0.4])  # what training added on each seed
    # listed in another order than the reference; seed 2's live run fell, so it says nothing
    offline = [seeded(3, (0, 0.1), (4, 0.5)), seeded(2, (0, 0.7), (1, 0.1)), seeded(1, (0, 0.1), (4, 0.5))]
    verdict = within_fraction_of_seconds(offline, live)
    level = 0.5 - spread
    assert verdict["levels"] == pytest.approx([level, level])  # seeds 3 and 1 only
    assert verdict["seconds"] == pytest.approx(4 * (level - 0.1) / 0.4)
    assert verdict["reference_seconds"] == pytest.approx(10 * (level - 0.1) / 0.2)
    assert verdict["answer"] is True and verdict["reached"] == "2/2"
    fell = [seeded(2, (0, 0.7), (10, 0.6))]  # no seed where the reference rose: undecided, and it says why
    verdict = within_fraction_of_seconds(fell, [live[1]])
    assert verdict["answer"] is None and verdict["text"].startswith("undecided")


def test_benchmark_smoke_writes_its_json(tmp_path):
    from benchmarks.accuracy.bench_time_to_accuracy import FROM_STORE, OURS_GKD, RECIPES, SERVED_GKD, TRL_RECIPES, main

    has = lambda *modules: all(importlib.util.find_spec(m) is not None for m in modules)  # noqa: E731
    recipes = [*RECIPES, *(TRL_RECIPES if has("trl", "datasets") else ())]
    if not has("fastapi", "uvicorn"):  # the served row needs `liger-kd serve`'s app
        recipes.remove(SERVED_GKD)
    out = tmp_path / "tta.json"
    payload = main(["--smoke", "--out", str(out), "--recipes", *recipes])
    written = json.loads(out.read_text())
    assert written["failed"] == {} and payload["failed"] == {}
    assert set(written["runs"]) == set(recipes)
    for name, runs in written["runs"].items():
        assert len(runs) == 1, name
        curve = runs[0]["curve"]
        assert curve[0]["step"] == 0 and curve[-1]["step"] >= 1
        assert all(0.0 <= c["accuracy"] <= 1.0 for c in curve)
        assert [c["seconds"] for c in curve] == sorted(c["seconds"] for c in curve)
    assert set(written["summary"]["recipes"]) == set(recipes)
    for name in FROM_STORE:  # the store's seconds start the clock and are in every later checkpoint
        run = written["runs"][name][0]
        store = run["store"]
        assert store["completions"] == 4 * 8 and store["bytes"] > 0 and store["seconds"] > 0  # --steps x --batch
        assert run["curve"][1] == dict(step=0, seconds=store["seconds"], accuracy=run["curve"][0]["accuracy"])
        assert run["curve"][-1]["seconds"] > store["seconds"]
        assert written["summary"]["recipes"][name]["store_seconds"][0] == pytest.approx(store["seconds"])
        verdict = written["summary"]["offline_vs_live"][name]
        assert verdict["answer"] in (True, False, None) and OURS_GKD in verdict["question"]
        assert run["behaviour_kl"] is not None and run["behaviour_kl"] >= 0.0  # logged at the last step
    assert written["runs"][FROM_STORE[0]][0]["refreshed_steps"] == []
    assert written["runs"][FROM_STORE[1]][0]["refreshed_steps"] == [1, 2, 3]  # every step after the first
    if SERVED_GKD in recipes:
        assert written["runs"][SERVED_GKD][0]["served_tokens"] > 0
    assert 0.0 <= written["teacher"]["accuracy"] <= 1.0


def test_phases_time_the_steps_they_nest_in(tmp_path):
    """--phases: per step, compute_loss is part of training_step and the teacher's forward part of compute_loss;
    the on-policy row's rollouts are sampled in get_batch_samples, before training_step."""
    from benchmarks.accuracy.bench_time_to_accuracy import OURS_GKD, main

    out = tmp_path / "tta.json"
    main(["--smoke", "--phases", "--out", str(out), "--recipes", OURS_GKD])
    phases = json.loads(out.read_text())["runs"][OURS_GKD][0]["phases"]
    assert phases["steps"] >= 1 and phases["step_ms"] > 0
    ms = {name: p["ms_per_step"] for name, p in phases["phases"].items()}
    assert {p["calls_per_step"] for p in phases["phases"].values()} == {1.0}  # one micro-batch a step
    assert ms["teacher backbone forward"] <= ms["compute_loss"] <= ms["training_step"]
    assert ms["student generate"] <= ms["get_batch_samples"]
    assert ms["get_batch_samples"] + ms["training_step"] <= phases["step_ms"] * 1.05  # drained: they add up
    profiled = phases["kernels"]  # on a CPU: no kernels, the host's ops
    assert profiled["kernels_per_step"] == 0 and profiled["wall_ms_per_step"] > 0
    assert any(op["name"].startswith("aten::") and op["per_step"] >= 1 for op in profiled["host_top"])


def test_the_benchmark_splits_over_calls_with_resume(tmp_path):
    """--resume keeps the runs of an earlier call (same options) and runs only the recipe and seed pairs it lacks;
    the SFT row, run in the second call, runs as long as the first call's longest distillation row of its seed;
    a file written with other options is refused before anything trains; --summarize rebuilds the table."""
    from benchmarks.accuracy.bench_time_to_accuracy import OURS_GKD, SFT, main

    out, teacher = tmp_path / "tta.json", tmp_path / "teacher"
    first = main(["--smoke", "--out", str(out), "--teacher-dir", str(teacher), "--recipes", "off-policy KD, JSD"])
    kept = first["runs"]["off-policy KD, JSD (beta 0.5)"][0]
    second = main(["--smoke", "--out", str(out), "--teacher-dir", str(teacher), "--resume", "--recipes",
                   "off-policy KD, JSD", OURS_GKD, SFT])  # fmt: skip
    runs = json.loads(out.read_text())["runs"]
    assert runs["off-policy KD, JSD (beta 0.5)"] == [kept]  # not run again
    assert [len(runs[name]) for name in (OURS_GKD, SFT)] == [1, 1]
    assert set(second["summary"]["recipes"]) == {"off-policy KD, JSD (beta 0.5)", OURS_GKD, SFT}
    with pytest.raises(SystemExit, match="digits: 2 there, 3 here"):
        main(["--smoke", "--out", str(out), "--resume", "--digits", "3", "--recipes", SFT])
    assert main(["--summarize", str(out)])["summary"]["cut_short"] is False


def test_store_steps_sizes_the_store_and_the_offline_pass(tmp_path):
    from benchmarks.accuracy.bench_time_to_accuracy import OFFLINE, SFT, main

    out = tmp_path / "tta.json"
    main(["--smoke", "--out", str(out), "--recipes", SFT, OFFLINE, "--store-steps", "2"])
    run = json.loads(out.read_text())["runs"][OFFLINE][0]
    assert run["store"]["completions"] == 2 * 8  # --store-steps x --batch, not --steps (4) x --batch
    assert run["curve"][-1]["step"] == 2  # one pass over the store


def test_store_epochs_trains_that_many_passes_and_resume_refuses_another_count(tmp_path):
    """--store-epochs E: the offline row trains E whole passes over its store (E x its steps), not one; a store of
    16 completions in prompts of 16 (--store-generations above --batch) is two steps a pass. --resume refuses a file
    written with another --store-epochs before anything trains."""
    from benchmarks.accuracy.bench_time_to_accuracy import OFFLINE, main

    out = tmp_path / "tta.json"
    main(["--smoke", "--out", str(out), "--recipes", OFFLINE, "--store-steps", "2", "--store-epochs", "2"])
    run = json.loads(out.read_text())["runs"][OFFLINE][0]
    assert run["store"]["completions"] == 2 * 8 and run["curve"][-1]["step"] == 4  # 2 passes of 2 steps
    with pytest.raises(SystemExit, match="store_epochs: 2 there, 1 here"):
        main(["--smoke", "--out", str(out), "--resume", "--recipes", OFFLINE, "--store-steps", "2"])
    main(["--smoke", "--out", str(tmp_path / "g.json"), "--recipes", OFFLINE, "--store-steps", "1",
          "--store-generations", "16"])  # fmt: skip
    run = json.loads((tmp_path / "g.json").read_text())["runs"][OFFLINE][0]
    assert run["store"]["completions"] == 16 and run["curve"][-1]["step"] == 2  # one whole pass of 2 steps


@pytest.mark.parametrize("options,needles", [
    (["--store-epochs", "2"], ["--store-epochs 2", "8 steps", "--steps 4", "--store-steps 2"]),
    (["--store-steps", "3", "--store-epochs", "2"], ["--store-epochs 2", "6 steps", "--steps 4", "--store-steps 2"]),
    (["--store-steps", "6"], ["--store-steps 6", "6 steps", "--steps 4"]),
])  # fmt: skip
def test_passes_over_the_store_that_do_not_fit_the_steps_are_refused_before_anything_trains(tmp_path, options,
                                                                                           needles):  # fmt: skip
    """--store-epochs E over a store of S steps' rows trains S x E steps; past --steps the row was cut to --steps
    (with the default --store-steps, --steps, every E trained one pass, the JSON saying E): refused in one line,
    naming the fix, before the task or the teacher is made."""
    from benchmarks.accuracy import bench_time_to_accuracy as bench

    with pytest.raises(SystemExit) as e:
        bench.main(["--smoke", "--out", str(tmp_path / "tta.json"), "--recipes", bench.OFFLINE, *options])
    message = str(e.value)
    assert "\n" not in message and all(n in message for n in needles), message
    assert not (tmp_path / "tta.json").exists()
    bench.main(["--smoke", "--out", str(tmp_path / "sft.json"), "--recipes", bench.SFT, *options])  # no store row


def test_format_tuned_students_are_kept_beside_the_teacher(tmp_path, monkeypatch):
    """A resumed call must start its recipes from the first call's very students, not from a new fine-tune."""
    import liger_patch_kd.demo.arithmetic as arithmetic
    from benchmarks.accuracy.bench_time_to_accuracy import SMOKE, format_tuned_student, parser, task_data

    a = parser().parse_args(["--smoke", "--teacher-dir", str(tmp_path / "models")])
    for key, value in SMOKE.items():
        setattr(a, key, value)
    data = task_data(a)
    first = format_tuned_student(a, data, 1, torch.device("cpu"))
    (kept,) = (tmp_path / "models").iterdir()
    assert kept.name == "student_seed1_32x2_format10_lr0.001"
    fit = arithmetic.fit_on_ground_truth

    def no_fine_tune(*args, **kwargs):
        raise AssertionError("the kept student should have been loaded, not fine-tuned again")

    monkeypatch.setattr(arithmetic, "fit_on_ground_truth", no_fine_tune)
    loaded = format_tuned_student(a, data, 1, torch.device("cpu"))
    assert all(torch.equal(p, q) for p, q in zip(first.state_dict().values(), loaded.state_dict().values()))
    monkeypatch.setattr(arithmetic, "fit_on_ground_truth", fit)
    a.format_steps += 1  # other format options: another student, fine-tuned anew and kept under its own name
    format_tuned_student(a, data, 1, torch.device("cpu"))
    a.format_lr = 0.01  # its own learning rate: another student again
    format_tuned_student(a, data, 1, torch.device("cpu"))
    names = sorted(p.name for p in (tmp_path / "models").iterdir())
    assert names == ["student_seed1_32x2_format10_lr0.001", "student_seed1_32x2_format11_lr0.001",
                     "student_seed1_32x2_format11_lr0.01"]  # fmt: skip


def test_speedup_against_trl_pairs_seeds_and_leaves_out_students_already_there():
    from benchmarks.accuracy.bench_time_to_accuracy import speedup

    def seeded(seed, *points):
        return {**curve(*points), "seed": seed}

    ours = [seeded(1, (0, 0.1), (5, 0.9)), seeded(2, (0, 0.8), (5, 0.7)), seeded(3, (0, 0.1), (2, 0.5))]
    theirs = [seeded(3, (0, 0.1), (10, 0.5)), seeded(1, (0, 0.1), (20, 0.9)), seeded(2, (0, 0.8), (20, 0.9))]
    verdict = speedup(ours, theirs, target=0.9)
    # seed 1 at the target (5 s against 20), seed 3 at the lower final 0.5 (2 s against 10); seed 2 fell below its
    # start on our side, so its level (0.7) is one its student had before either trainer ran: left out
    assert verdict["levels"] == pytest.approx([0.9, 0.5])
    assert verdict["ours_seconds"] == pytest.approx(3.5) and verdict["trl_seconds"] == pytest.approx(15.0)
    assert verdict["ratio"] == pytest.approx(15.0 / 3.5)
    assert verdict["ratio_by_seed"] == pytest.approx([4.0, 5.0]) and "(by seed 4.0x, 5.0x)" in verdict["text"]
    fell = speedup([ours[1]], [theirs[2]], target=0.9)
    assert fell["ratio"] is None and fell["text"].startswith("undecided")


def test_wrong_answers_are_a_seeded_share_each_a_consistent_wrong_solution():
    from liger_patch_kd.demo.arithmetic import with_wrong_answers

    problems = ArithmeticTask(operands=3, digits=2).problems(2000, seed=0)
    assert with_wrong_answers(problems, 0.0, seed=1) == problems
    noisy = with_wrong_answers(problems, 0.3, seed=1)
    assert noisy == with_wrong_answers(problems, 0.3, seed=1)  # the seed decides which, and how
    wrong = [(p, n) for p, n in zip(problems, noisy) if n != p]
    # a binomial share: 600 expected, 4 standard deviations (20.5 each) either side
    assert abs(len(wrong) - 600) < 4 * (2000 * 0.3 * 0.7) ** 0.5
    for right, given in wrong:
        assert given.prompt == right.prompt and given.answer != right.answer and given.answer >= 0
        assert 1 <= abs(given.answer - right.answer) <= 9
        assert final_answer(given.completion) == given.answer  # it reads as one solution, wrong at its end
        last_step = given.completion.rsplit(";", 1)[-1]
        assert last_step.split("=")[0] == right.completion.rsplit(";", 1)[-1].split("=")[0]  # same operands
        assert given.completion.rsplit(";", 1)[0] == right.completion.rsplit(";", 1)[0]  # earlier steps kept
    assert all(n.answer != p.answer for p, n in zip(problems, with_wrong_answers(problems, 1.0, seed=1)))
    with pytest.raises(ValueError, match="fraction"):
        with_wrong_answers(problems, 1.5, seed=1)


def test_label_noise_reaches_the_students_rows_and_not_the_teachers():
    from benchmarks.accuracy.bench_time_to_accuracy import SMOKE, parser, task_data

    a = parser().parse_args(["--smoke", "--label-noise", "0.5"])
    for key, value in SMOKE.items():
        setattr(a, key, value)
    data = task_data(a)
    tok, task = data["tokenizer"], data["task"]
    right = task.problems(a.train_problems, seed=0)
    decode = lambda ids: tok.decode([i for i in ids if i != EOS])  # noqa: E731
    teacher_wrong = sum(final_answer(decode(c)) != p.answer for c, p in zip(data["completions"], right))
    student_wrong = sum(final_answer(decode(c)) != p.answer for c, p in zip(data["labels"], right))
    rows_wrong = sum(final_answer(r["completion"]) != p.answer for r, p in zip(data["rows"], right))
    assert teacher_wrong == 0
    assert student_wrong == rows_wrong and abs(student_wrong - 1000) < 4 * (2000 * 0.25) ** 0.5
    assert [r["completion_ids"] for r in data["token_rows"]] == data["labels"]


def test_labelled_gives_the_students_few_solutions_and_every_prompt():
    """--labelled N: the rows that need a solution hold the first N problems' (right ones), the prompt-only rows
    every training prompt with no solution in them; the teacher's data stays whole. Without it both are the same."""
    from benchmarks.accuracy.bench_time_to_accuracy import SMOKE, parser, task_data

    a = parser().parse_args(["--smoke", "--labelled", "100"])
    for key, value in SMOKE.items():
        setattr(a, key, value)
    data = task_data(a)
    right = data["task"].problems(a.train_problems, seed=0)
    assert len(data["completions"]) == len(data["prompts"]) == a.train_problems  # the teacher's: every solution
    assert len(data["rows"]) == len(data["token_rows"]) == len(data["labels"]) == len(data["labelled_prompts"]) == 100
    assert [r["completion"] for r in data["rows"]] == [p.completion for p in right[:100]]
    assert data["labels"] == data["completions"][:100] and data["labelled_prompts"] == data["prompts"][:100]
    assert [r["prompt"] for r in data["prompt_rows"]] == [p.prompt for p in right]
    assert all(set(r) == {"prompt"} for r in data["prompt_rows"])
    # TRL's GKDTrainer normalises by the rows' label count: placeholders as long as the solutions, never their tokens
    eos = data["tokenizer"].eos_token_id
    assert [r["completion_ids"] for r in data["prompt_token_rows"]] == [[eos] * len(c) for c in data["completions"]]
    a.labelled = 0
    whole = task_data(a)
    assert whole["prompt_rows"] is whole["rows"] and len(whole["rows"]) == a.train_problems
    a.labelled = a.train_problems + 1
    with pytest.raises(SystemExit, match=r"--labelled 2001: give 0 \(every problem labelled\) up to"):
        task_data(a)


def test_the_demo_and_the_benchmark_split_the_task_alike():
    """One builder (arithmetic.split_task) behind both: at the same sizes the demo's rows and the benchmark's are the
    same problems and ids; labelled past the training problems is refused naming both counts."""
    import liger_patch_kd.demo.arithmetic_students as AS
    from benchmarks.accuracy.bench_time_to_accuracy import SMOKE, parser, task_data

    sizes = AS.ArithmeticDemoSizes.tiny()
    demo = AS.task_data(sizes)
    a = parser().parse_args(["--smoke"])
    for key, value in SMOKE.items():
        setattr(a, key, value)
    a.operands, a.digits, a.held_out_every = sizes.operands, sizes.digits, sizes.held_out_every
    a.train_problems, a.labelled, a.held_out = sizes.train_problems, sizes.labelled, sizes.held_out
    bench = task_data(a)
    assert demo["prompts"] == bench["prompts"] and demo["completions"] == bench["completions"]
    assert demo["labelled_token_rows"] == bench["token_rows"] and demo["labelled_rows"] == bench["rows"]
    assert demo["prompt_rows"] == bench["prompt_rows"] and demo["held_out"] == bench["held_out"]
    assert demo["max_new_tokens"] == bench["max_new_tokens"] == max(map(len, demo["completions"])) + 1
    with pytest.raises(ValueError, match=r"labelled=201: give 0 \(every problem labelled\) up to train_problems=200"):
        split_task(ArithmeticTask(), 200, 201, 8, held_out_name="n")


def test_labelled_runs_prompt_only_recipes_on_every_prompt(tmp_path, capsys):
    from benchmarks.accuracy.bench_time_to_accuracy import OURS_GKD, SFT, main

    out = tmp_path / "tta.json"
    payload = main(["--smoke", "--out", str(out), "--labelled", "50", "--recipes", SFT, OURS_GKD])
    task = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("task: "))
    assert task.startswith("task: 2000 training problems (50 with a worked solution), 24 held out"), task
    assert payload["failed"] == {} and payload["config"]["labelled"] == 50
    assert all(len(payload["runs"][name]) == 1 for name in (SFT, OURS_GKD))
