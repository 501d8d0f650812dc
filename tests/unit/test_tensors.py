"""PyTorch tensors in the namespace image (gpuhub/kernel/tensors.py): storages out of band, shared
storages shared, everything else as torch pickles it."""

from __future__ import annotations

import pickle

import pytest

from gpuhub.kernel import image

torch = pytest.importorskip("torch")

MIB = 1 << 20


def roundtrip(ns: dict, readonly: bool = False) -> tuple[image.Capture, dict]:
    cap = image.capture(ns, set())
    assert cap.failed == {}
    buffers = [bytes(b) if readonly else bytearray(b) for b in cap.buffers]
    return cap, image.load(cap.stream, buffers)


def test_a_models_parameters_and_optimizer_state_leave_the_stream():
    model = torch.nn.Linear(1024, 1024)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 1024)).sum().backward()
    opt.step()
    cap, out = roundtrip({"model": model, "opt": opt})
    assert len(cap.stream) < 64 * 1024  # was ≈ 12 MiB: every storage through torch.save, every cell
    assert sorted(b.nbytes for b in cap.buffers) == [4 * MIB] * 3  # weight, exp_avg, exp_avg_sq
    p = out["model"].weight
    assert type(p) is torch.nn.Parameter and p.requires_grad and p.is_leaf
    assert out["opt"].param_groups[0]["params"][0] is p  # the optimizer still updates the model
    assert torch.equal(p, model.weight)
    assert torch.equal(out["opt"].state[p]["exp_avg"], opt.state[model.weight]["exp_avg"])


def test_an_unchanged_storage_keeps_its_digest_and_a_changed_one_does_not():
    t = torch.randn(MIB)  # 4 MiB
    first = image.capture({"t": t}, set())
    from gpuhub.replication.digest import digest

    before = digest(first.buffers[0])
    assert digest(image.capture({"t": t}, set()).buffers[0]) == before
    t[0] += 1
    assert digest(image.capture({"t": t}, set()).buffers[0]) != before


def test_views_share_their_storage_again_and_layouts_and_dtypes_survive():
    base = torch.arange(MIB, dtype=torch.float32)
    ns = {"base": base, "view": base[2:5], "t": torch.ones(1000, 600).t(), "bf": torch.ones(MIB, dtype=torch.bfloat16),
          "small": torch.tensor([1, 2, 3]), "grad": torch.ones(3, requires_grad=True)}
    cap, out = roundtrip(ns)
    assert len(cap.buffers) == 3  # base once for both names; t; bf (small stays in the stream)
    out["base"][3] = -1
    assert out["view"][1].item() == -1  # a plain ipykernel's `view` sees it too
    assert out["t"].stride() == (1, 600) and torch.equal(out["t"], ns["t"])
    assert out["bf"].dtype is torch.bfloat16 and torch.equal(out["bf"], ns["bf"])
    assert torch.equal(out["small"], ns["small"]) and out["grad"].requires_grad and out["grad"].is_leaf


def test_read_only_buffers_are_copied_and_empty_tensors_are_not_linked():
    a = torch.zeros(MIB)
    _, out = roundtrip({"a": a, "e1": torch.empty(0), "e2": torch.empty(0)}, readonly=True)
    out["a"][0] = 5  # writable memory of its own
    assert out["a"][0].item() == 5 and a[0].item() == 0
    out["e1"].resize_(4)
    assert out["e2"].shape == (0,)


def test_other_tensors_pickle_as_torch_pickles_them():
    with_attr = torch.ones(MIB)
    with_attr.note = "kept"
    non_leaf = torch.ones(3, requires_grad=True) * 2
    sparse = torch.eye(4).to_sparse()
    cap, out = roundtrip({"with_attr": with_attr, "non_leaf": non_leaf, "sparse": sparse})
    assert cap.buffers == []  # torch's own reductions: in the stream
    assert out["with_attr"].note == "kept" and torch.equal(out["with_attr"], with_attr)
    assert out["non_leaf"].requires_grad and torch.equal(out["non_leaf"].detach(), non_leaf.detach())
    assert torch.equal(out["sparse"].to_dense(), torch.eye(4))
    assert pickle.loads(pickle.dumps(with_attr)).note == "kept"
