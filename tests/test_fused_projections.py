"""generation.fused_projections: q/k/v and gate/up as one product each over a session-owned copy of the weights.
The decode engine with them samples what the plain reference loop samples, sees weights updated in place at its
next call (the copy is refreshed), and leaves the model as it was (parameters, modules, gradients)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from liger_patch_kd.generation import Sampling, decode, release_sessions
from liger_patch_kd.generation.engine import session_of
from liger_patch_kd.generation.fused_projections import FusedProjections

from .test_generation import _model, _prompts, decodes_as_the_reference, reference

pytestmark = pytest.mark.usefixtures("clean_patches")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_decode_samples_what_the_uncached_reference_samples(arch):
    model = _model(arch, torch.float64, seed=1)
    sampling = Sampling(temperature=0.7, top_k=20, top_p=0.9, vocab_limit=250)
    decodes_as_the_reference(model, sampling, fuse_projections=True)
    layers = model.config.num_hidden_layers
    assert len(session_of(model).projection_copies.groups) == 2 * layers  # q/k/v and gate/up of every layer
    release_sessions(model)


def test_fused_weights_follow_updates_made_in_place():
    model = _model("llama", torch.float64, seed=3)
    ids, mask = _prompts()
    greedy = Sampling(temperature=0.0)
    before, _ = decode(model, ids, mask, max_new_tokens=5, sampling=greedy, pad_id=0, fuse_projections=True)
    with torch.no_grad():  # an optimizer step: the same storage, new values (the session's copy is now stale)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    after, _ = decode(model, ids, mask, max_new_tokens=5, sampling=greedy, pad_id=0, fuse_projections=True)
    want, _ = reference(model, ids, mask, 5, greedy, 0, ())
    assert torch.equal(after, want)
    assert not torch.equal(after, before)
    release_sessions(model)


def test_installed_projections_leave_the_model_and_its_gradients_as_they_were():
    model = _model("llama", torch.float64, seed=4)
    ids, _ = _prompts()
    params = {name: (p, p.data_ptr()) for name, p in model.named_parameters()}
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    model(input_ids=ids).logits.square().mean().backward()
    plain_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    fused = FusedProjections(model)
    fused.sync()
    with fused.installed():
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, plain, rtol=1e-12, atol=1e-12)
        model(input_ids=ids).logits.square().mean().backward()  # with gradients: the model's own weights
    for name, p in model.named_parameters():
        assert p is params[name][0] and p.data_ptr() == params[name][1]
        torch.testing.assert_close(p.grad, plain_grads[name], rtol=1e-12, atol=1e-12)
    assert not any("forward" in m.__dict__ for m in model.modules() if isinstance(m, nn.Linear))
    assert all(g.last is None for g in fused.groups)  # no step's tensors kept


def test_a_forward_keeps_none_of_its_outputs_once_every_projection_has_taken_its_own():
    """A prefill's projections are large (64 rows of 512 tokens: 1 GiB a layer for a 1B Llama's gate/up): a group
    kept them until its next call, so every layer's were alive at once (24 GiB above the training step's peak)."""
    model = _model("llama", torch.float64, seed=5)
    ids, _ = _prompts()
    fused = FusedProjections(model)
    fused.sync()
    with torch.no_grad(), fused.installed():
        model(input_ids=ids)
        assert all(g.last is None for g in fused.groups)


def test_a_projection_fed_another_input_computes_its_own_and_wrapped_linears_are_left_alone():
    class Wrapped(nn.Linear):  # what a LoRA or quantized layer looks like to the grouping
        pass

    block = nn.Module()
    block.q_proj, block.k_proj, block.v_proj = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)
    block.gate_proj, block.up_proj = Wrapped(8, 16), nn.Linear(8, 16)
    fused = FusedProjections(block)
    assert [len(g.linears) for g in fused.groups] == [3]
    fused.sync()
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    with torch.no_grad(), fused.installed():
        torch.testing.assert_close(block.q_proj(x), F.linear(x, block.q_proj.weight, block.q_proj.bias))
        torch.testing.assert_close(block.k_proj(x), F.linear(x, block.k_proj.weight, block.k_proj.bias))
        torch.testing.assert_close(block.v_proj(y), F.linear(y, block.v_proj.weight, block.v_proj.bias))
        block.q_proj(x)
        block.k_proj(x)
        torch.testing.assert_close(block.k_proj(x), F.linear(x, block.k_proj.weight, block.k_proj.bias))  # taken twice


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_captured_fused_step_replays_and_sees_in_place_updates():
    model = _model("llama", torch.float32, seed=7).to(DEVICE)
    ids, mask = _prompts(DEVICE)
    sampling = Sampling(temperature=0.9, top_k=50)
    runs = []  # the same kernels eager and captured: the same draws
    for run_capture in ("eager", "graph", "graph"):
        torch.manual_seed(11)
        runs.append(decode(model, ids, mask, max_new_tokens=12, sampling=sampling, pad_id=0,
                           capture=run_capture, fuse_projections=True)[0])  # fmt: skip
    assert torch.equal(runs[1], runs[0]) and torch.equal(runs[2], runs[0])
    greedy = Sampling(temperature=0.0)
    decode(model, ids, mask, max_new_tokens=12, sampling=greedy, pad_id=0, capture="graph", fuse_projections=True)
    graph = session_of(model).graph
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0).add_(torch.randn_like(p) * 0.3)
    got, _ = decode(model, ids, mask, max_new_tokens=12, sampling=greedy, pad_id=0, capture="graph",
                    fuse_projections=True)  # fmt: skip
    assert session_of(model).graph is graph  # replayed, not recaptured
    want, _ = reference(model, ids, mask, 12, greedy, 0, ())
    assert torch.equal(got, want)
    release_sessions(model)


def test_a_tail_whose_input_changed_in_place_computes_its_own():
    """A tail takes the head's product only for the very input, unchanged: changed in place in between, it computes
    from what the input now holds (it returned the stale product)."""
    block = nn.Module()
    block.q_proj, block.k_proj, block.v_proj = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)
    fused = FusedProjections(block)
    fused.sync()
    assert fused.nbytes() == sum(t.numel() * t.element_size() for t in fused.tensors())  # biases counted
    x = torch.randn(2, 8)
    with torch.no_grad(), fused.installed():
        block.q_proj(x)
        x.mul_(3)
        torch.testing.assert_close(block.k_proj(x), F.linear(x, block.k_proj.weight, block.k_proj.bias))


@pytest.mark.parametrize("fuse", [True, False])
def test_float32_weights_under_autocast_are_held_cast_and_decode_the_same_bits(monkeypatch, fuse):
    """float32 weights under bfloat16 autocast: the session holds every plain Linear's weights in bfloat16 (fused
    or alone), cast once a call, where autocast cast them at every product of every step. The tokens and log-probs
    are bit for bit those of the same decode with autocast casting (the copy is autocast's cast), and an update
    made in place is in the next call's copies."""
    import liger_patch_kd.generation.fused_projections as copies

    model = _model("llama", torch.float32, seed=5)
    ids, mask = _prompts()
    runs = {}
    for held in (False, True):
        if not held:  # autocast casts the weights at every product, as before the copies
            monkeypatch.setattr(copies, "_cast_dtype", lambda linear, autocast: None)
        torch.manual_seed(0)
        with torch.autocast("cpu", torch.bfloat16):
            runs[held] = decode(model, ids, mask, max_new_tokens=6, sampling=Sampling(), pad_id=0, logprobs=True,
                                fuse_projections=fuse)  # fmt: skip
        monkeypatch.undo()
        session = session_of(model)
        if held:
            linears = [m for m in session.model.modules() if type(m) is nn.Linear]
            covered = {id(lin) for group in session.projection_copies.groups for lin in group.linears}
            assert covered == {id(lin) for lin in linears}  # q/k/v, o, gate/up, down of every layer, lm_head
            assert all(group.weight.dtype == torch.bfloat16 for group in session.projection_copies.groups)
            layers = model.config.num_hidden_layers  # fused: q/k/v and gate/up; alone: o and down; and lm_head
            assert len(session.projection_copies.groups) == (4 * layers + 1 if fuse else len(linears))
        else:
            groups = session.projection_copies.groups if session.projection_copies is not None else []
            assert not fuse or all(g.weight.dtype == torch.float32 for g in groups)
        release_sessions(model)
    assert torch.equal(runs[True][0], runs[False][0]) and torch.equal(runs[True][1], runs[False][1])
    head = model.lm_head.weight
    with torch.autocast("cpu", torch.bfloat16):
        decode(model, ids, mask, max_new_tokens=2, sampling=Sampling(), pad_id=0, fuse_projections=fuse)
        with torch.no_grad():
            head.add_(1.0)  # in place: the session's copy is stale until its next call
        decode(model, ids, mask, max_new_tokens=2, sampling=Sampling(), pad_id=0, fuse_projections=fuse)
    (copy,) = [g.weight for g in session_of(model).projection_copies.groups if g.linears[0].weight is head]
    assert torch.equal(copy, head.detach().to(torch.bfloat16))
    release_sessions(model)


def test_a_cast_copy_stands_in_only_under_the_autocast_it_was_made_for():
    """A projection the model runs outside autocast (a float32 router under autocast(enabled=False)) gets its own
    float32 weights, not the bfloat16 copy; with gradients on, the model's own weights too."""
    linear = nn.Linear(8, 4)
    copies = FusedProjections(nn.Sequential(linear), fuse=False, autocast=torch.bfloat16)
    copies.sync()
    x = torch.randn(3, 8)
    with copies.installed(), torch.no_grad():
        with torch.autocast("cpu", torch.bfloat16):
            cast = linear(x)
            with torch.autocast("cpu", enabled=False):
                plain = linear(x)
        with torch.autocast("cpu", torch.float16):  # another autocast dtype: not this copy's
            half = linear(x)
    assert cast.dtype == torch.bfloat16 and plain.dtype == torch.float32 and half.dtype == torch.float16
    torch.testing.assert_close(plain, F.linear(x, linear.weight, linear.bias), rtol=0, atol=0)
    with torch.autocast("cpu", torch.bfloat16):
        assert torch.equal(cast, F.linear(x, linear.weight, linear.bias))  # autocast's own cast: the same bits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_step_with_cast_copies_decodes_the_same_bits_under_cuda_autocast(monkeypatch):
    """float32 weights under CUDA bf16 autocast, the step captured: with the session's bf16 copies (cast once a
    call) the same tokens and log-probs as with autocast casting at every product, and an update in place is in
    the next call's copies."""
    import liger_patch_kd.generation.fused_projections as copies

    model = _model("llama", torch.float32, seed=8).to(DEVICE)
    ids, mask = _prompts(DEVICE)
    runs = {}
    for held in (False, True):
        if not held:
            monkeypatch.setattr(copies, "_cast_dtype", lambda linear, autocast: None)
        with torch.autocast("cuda", torch.bfloat16):
            for _ in range(2):  # capture, then replay
                torch.manual_seed(2)
                runs[held] = decode(model, ids, mask, max_new_tokens=10, sampling=Sampling(), pad_id=0,
                                    logprobs=True, capture="graph", fuse_projections=True)  # fmt: skip
        monkeypatch.undo()
        release_sessions(model)
    assert torch.equal(runs[True][0], runs[False][0]) and torch.equal(runs[True][1], runs[False][1])
    greedy = Sampling(temperature=0.0)
    with torch.autocast("cuda", torch.bfloat16):
        before, _ = decode(model, ids, mask, max_new_tokens=10, sampling=greedy, pad_id=0, capture="graph")
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-1.0)
        after, _ = decode(model, ids, mask, max_new_tokens=10, sampling=greedy, pad_id=0, capture="graph")
        release_sessions(model)
        fresh, _ = decode(model, ids, mask, max_new_tokens=10, sampling=greedy, pad_id=0, capture="graph")
    assert torch.equal(after, fresh)  # the kept session's copies are the updated weights', as a new session's
    assert not torch.equal(after, before)
    release_sessions(model)


@pytest.mark.parametrize("fuse", [False, True])
def test_float64_weights_under_bf16_autocast_get_no_cast_copies(monkeypatch, fuse):
    """Autocast never casts float64 tensors (a float64 product stays float64): the session holds no bfloat16 copy
    of float64 weights, and decodes as without copies (a copy made the step multiply a float64 input by a bfloat16
    weight and crash)."""
    import liger_patch_kd.generation.fused_projections as copies

    model = _model("llama", torch.float64, seed=1)
    ids, mask = _prompts()
    runs = []
    for cast in (False, True):
        with monkeypatch.context() as patch:
            if not cast:
                patch.setattr(copies, "_cast_dtype", lambda *a: None)
            release_sessions(model)
            torch.manual_seed(3)
            with torch.autocast("cpu", torch.bfloat16):
                runs.append(decode(model, ids, mask, max_new_tokens=5, sampling=Sampling(), pad_id=0,
                                   capture="eager", logprobs=True, fuse_projections=fuse))  # fmt: skip
    release_sessions(model)
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
