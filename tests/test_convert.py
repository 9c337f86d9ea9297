"""The offline compile on the real SmolLM2 GGUF: profile, predictors, placement, bundle."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

import pijax
from pijax import bundle_load
from pijax.formats import bundle as bundle_lib
from pijax.errors import BundleError
from pijax.profile import Profile, layer_active

pytestmark = pytest.mark.slow
ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_manifest(converted, smollm2, smollm2_path):
  opts, manifest = converted
  on_disk = json.loads((pathlib.Path(opts.out) / "manifest.json").read_text())
  assert on_disk["source"]["sha256"] == manifest["source"]["sha256"]
  assert on_disk["calibration"]["tokens"] == 12 * 512
  assert len(on_disk["layers"]) == smollm2.config.n_layers
  assert on_disk["totals"]["mean_recall"] >= 0.9
  for layer in on_disk["layers"]:
    assert layer["predictor_rank"] in (16, 32)
    assert 0 <= layer["hot_count"] <= smollm2.config.intermediate_size
    assert layer["hot_count"] % 64 == 0
    for key in ("threshold", "recall", "precision", "predicted_sparsity", "true_sparsity"):
      assert key in layer
  assert on_disk["device"]["device_bytes"] <= on_disk["device"]["budget_bytes"] == int(0.4e9)
  assert not [p for p in os.listdir(pathlib.Path(opts.out).parent) if ".tmp-" in p]
  # The rule a CPU run uses (host engine, contribution at the thresholds), on the test split
  # (1 chunk of 512 here) against the f32 model's true sets: int8 products move few neurons.
  rule = on_disk["host_rule"]
  assert rule["rule"] == "contribution" and rule["split"] == "test" and rule["tokens"] == 512
  assert rule["recall"] >= 0.9 and rule["precision"] >= 0.9
  assert abs(rule["predicted_sparsity"] - rule["true_sparsity"]) < 0.05
  assert len(rule["layers"]) == smollm2.config.n_layers


def test_thresholds_hit_target_sparsity(converted, smollm2):
  """SwiGLU thresholds give the target sparsity (0.5) +-1% on the calibration text."""
  opts, _ = converted
  prof = Profile.load(opts.workdir)
  assert prof.sparsity.shape == (smollm2.config.n_layers,)
  assert np.all(np.abs(prof.sparsity - 0.5) <= 0.01), prof.sparsity
  # And recomputed independently for two layers from the recorded inputs, train split.
  inputs = prof.ffn_inputs(smollm2.config)
  for layer in (0, 17):
    active = layer_active(smollm2.params, smollm2.config, layer, np.asarray(inputs[layer]),
                          float(prof.thresholds[layer]))
    train = active[prof.split == 0]
    assert abs(1.0 - train.mean() - 0.5) <= 0.01
    np.testing.assert_array_equal(train.sum(0), prof.counts[layer])


def test_bundle_roundtrip_and_permutation_invariance(converted, smollm2, hf_tokenizer):
  opts, manifest = converted
  tree = bundle_lib.read_checkpoint(opts.out)
  perm = tree["perm"]
  # Each layer's permutation is a permutation, sorted by descending frequency.
  for layer in range(smollm2.config.n_layers):
    assert sorted(perm[layer].tolist()) == list(range(smollm2.config.intermediate_size))
    assert np.all(np.diff(tree["frequencies"][layer]) <= 0)
  # Version 2 stores no weights: the load gathers the source's rows in the bundle's order,
  # bit for bit, and the bundle is a fraction of the GGUF (version 1: 538 MB of f32 rows).
  assert "ffn" not in tree and manifest["version"] == 2
  on_disk = sum(f.stat().st_size for f in pathlib.Path(opts.out).rglob("*") if f.is_file())
  assert on_disk <= 0.3 * os.path.getsize(smollm2.path), on_disk
  expected = bundle_lib.permute_ffn(smollm2.params, smollm2.config.n_layers, perm)
  model = pijax.load(opts.out)
  assert model.sparse is not None
  assert model.sparse.hot_counts == [layer["hot_count"] for layer in manifest["layers"]]
  for name in ("layers_0", "layers_29"):
    for w in ("gate", "up", "down"):
      np.testing.assert_array_equal(bundle_load.rows(model)[name][w], expected[name][w])
  np.testing.assert_array_equal(bundle_load.rows(model)["layers_7"]["down"][11],
                                np.asarray(smollm2.params["layers_7"]["ffn"]["down"]["kernel"])
                                [perm[7, 11]])
  # pijax.load(bundle): the permuted model's logits equal the original's.
  ids = hf_tokenizer.encode("The permuted model computes exactly the same function.")
  ref = smollm2.prompt_logits(ids)
  got = model.prompt_logits(ids)
  assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


def test_version_1_bundle_with_stored_rows_still_loads(converted, smollm2, tmp_path):
  """A bundle written before version 2 (f32 rows in the checkpoint) loads those rows."""
  opts, manifest = converted
  tree = bundle_lib.read_checkpoint(opts.out)
  rows = bundle_lib.permute_ffn(smollm2.params, smollm2.config.n_layers, tree["perm"])
  rows["layers_3"]["up"] = rows["layers_3"]["up"] * np.float32(2.0)  # Tells the two apart.
  out = tmp_path / "v1"
  bundle_lib.write_bundle(str(out), dict(tree, ffn=rows), dict(manifest, version=1))
  bundle, _, _ = bundle_lib.open_bundle(str(out))
  np.testing.assert_array_equal(bundle.ffn["layers_3"]["up"], rows["layers_3"]["up"])
  bundle_lib.write_bundle(str(out), tree, dict(manifest, version=1), overwrite=True)
  with pytest.raises(BundleError, match="version 1 bundle without its ffn rows"):
    bundle_lib.open_bundle(str(out))


@pytest.mark.parametrize("corrupt", ["repeat", "range", "shape", "float", "missing", "swap"])
def test_bundle_with_a_bad_neuron_order_is_refused(converted, tmp_path, corrupt):
  """The rows are gathered by perm: anything but L permutations of range(F) is a BundleError."""
  opts, manifest = converted
  tree = bundle_lib.read_checkpoint(opts.out)
  perm = np.array(tree["perm"])
  if corrupt == "repeat":
    perm[4, 10] = perm[4, 11]
  elif corrupt == "range":
    perm[0, 0] = perm.shape[1]
  elif corrupt == "shape":
    perm = perm[:, :-1]
  elif corrupt == "float":
    perm = perm.astype(np.float32)
  elif corrupt == "swap":  # Still permutations, but not the order convert recorded.
    perm[[3, 4]] = perm[[4, 3]]
  tree = dict(tree, perm=perm)
  if corrupt == "missing":
    tree.pop("perm")
  out = tmp_path / corrupt
  bundle_lib.write_bundle(str(out), tree, manifest)
  with pytest.raises(BundleError, match=r"neuron order \(perm\) .* re-run pijax.convert"):
    bundle_lib.open_bundle(str(out))


def test_bundle_predictors_are_permuted_consistently(converted, smollm2):
  """Predictor outputs on a recorded input, mapped through perm, match the original order."""
  from pijax.offline import predictor as predictor_lib
  from pijax.train_predictors import load_predictors
  opts, _ = converted
  tree = bundle_lib.read_checkpoint(opts.out)
  original = load_predictors(opts.workdir) if os.path.exists(
      os.path.join(opts.workdir, "predictors.npz")) else None
  prof = Profile.load(opts.workdir)
  x = np.asarray(prof.ffn_inputs(smollm2.config)[3][:64])
  permuted = np.asarray(predictor_lib.predictor_logits(tree["predictors"]["layers_3"], x))
  fc2_unpermuted = np.empty_like(tree["predictors"]["layers_3"]["fc2"])
  fc2_unpermuted[:, tree["perm"][3]] = tree["predictors"]["layers_3"]["fc2"]
  unpermuted = np.asarray(predictor_lib.predictor_logits(
      {"fc1": tree["predictors"]["layers_3"]["fc1"], "fc2": fc2_unpermuted}, x))
  np.testing.assert_allclose(permuted, unpermuted[:, tree["perm"][3]], rtol=1e-6, atol=1e-6)
  del original


def test_bundle_version_and_source_mismatch(converted, tmp_path, smollm2_path):
  opts, _ = converted
  copy = tmp_path / "copy"
  shutil.copytree(opts.out, copy)
  manifest = json.loads((copy / "manifest.json").read_text())
  manifest["source"]["sha256"] = "0" * 64
  (copy / "manifest.json").write_text(json.dumps(manifest))
  with pytest.raises(BundleError, match="sha256"):
    pijax.load(str(copy))
  manifest["source"]["sha256"] = json.loads(
      (pathlib.Path(opts.out) / "manifest.json").read_text())["source"]["sha256"]
  manifest["version"] = 999
  (copy / "manifest.json").write_text(json.dumps(manifest))
  with pytest.raises(BundleError, match="version"):
    pijax.load(str(copy))


def test_convert_refuses_existing_out_and_tiny_budget(converted, shared_dir, tmp_path):
  opts, _ = converted
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cal = str(shared_dir / "data" / "tinyshakespeare" / "input.txt")
  proc = subprocess.run(
      [sys.executable, "-m", "pijax.convert", f"--out={opts.out}", f"--calibration={cal}",
       "--device_budget_gb=0.5"], cwd=ROOT, env=env, capture_output=True, text=True)
  assert proc.returncode == 2 and "already exists" in proc.stderr
  assert len(proc.stderr.strip().splitlines()) == 1
  out = tmp_path / "tiny_budget"
  proc = subprocess.run(
      [sys.executable, "-m", "pijax.convert", f"--out={out}", f"--calibration={cal}",
       "--device_budget_gb=0.1", "--max_tokens=1536", "--epochs=1", "--ranks=16"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 2, proc.stderr[-2000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert "bytes" in last and "100000000" in last
  assert not out.exists()
  assert not [p for p in os.listdir(tmp_path) if p.startswith("tiny_budget.tmp")]


def test_convert_makes_the_out_folders_parent(smollm2, shared_dir, tmp_path, monkeypatch):
  """--out=bundles/x in a fresh checkout (bundles/ missing) reached mkdtemp in the missing
  folder and died with a FileNotFoundError traceback (found running the README): the parent is
  made, as mkdir -p, and the work folder lands in it."""
  from pijax import convert as convert_mod

  class Reached(Exception):
    pass

  def stop(model, calibration, workdir, **kwargs):
    assert os.path.dirname(workdir) == str(tmp_path / "new" / "deeper")
    raise Reached

  monkeypatch.setattr(convert_mod, "profile_model", stop)
  opts = convert_mod.ConvertOptions(
      calibration=str(shared_dir / "data" / "tinyshakespeare" / "input.txt"),
      out=str(tmp_path / "new" / "deeper" / "b"), device_budget_bytes=int(0.4e9),
      ranks=(16, 32), progress=False)
  with pytest.raises(Reached):
    convert_mod.convert(smollm2, opts)
  assert (tmp_path / "new" / "deeper").is_dir() and not (tmp_path / "new" / "deeper" / "b").exists()


def test_budget_too_small_fails_before_profiling(smollm2, shared_dir, tmp_path, monkeypatch):
  """A budget that cannot hold the dense part is refused at once, not after profiling."""
  from pijax import convert as convert_mod
  from pijax.errors import BudgetError

  def no_profiling(*args, **kwargs):
    raise AssertionError("profiling started although the budget cannot hold the dense part")

  monkeypatch.setattr(convert_mod, "profile_model", no_profiling)
  opts = convert_mod.ConvertOptions(
      calibration=str(shared_dir / "data" / "tinyshakespeare" / "input.txt"),
      out=str(tmp_path / "b"), device_budget_bytes=int(0.1e9), ranks=(16, 32), progress=False)
  with pytest.raises(BudgetError, match="dense part needs"):
    convert_mod.convert(smollm2, opts)
  opts.device_budget_bytes, opts.hot_ratio = int(0.4e9), 1.0  # Dense fits, all neurons do not.
  with pytest.raises(BudgetError, match="hot_ratio=1.0"):
    convert_mod.convert(smollm2, opts)
  assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("manifest", [
    [1, 2],
    {"format": bundle_lib.BUNDLE_FORMAT, "version": bundle_lib.BUNDLE_VERSION},
    {"format": bundle_lib.BUNDLE_FORMAT, "version": bundle_lib.BUNDLE_VERSION,
     "source": {"path": "/", "sha256": "0"}, "layers": []},
])
def test_malformed_manifest_is_a_bundle_error(tmp_path, manifest):
  """A manifest that is not an object, lacks its source, or names a folder as the source."""
  from pijax.errors import BundleError
  (tmp_path / bundle_lib.MANIFEST_FILE).write_text(json.dumps(manifest))
  with pytest.raises(BundleError, match=str(tmp_path)):
    bundle_lib.open_bundle(str(tmp_path))


def test_write_bundle_never_replaces_a_non_bundle(tmp_path):
  """--overwrite replaces a bundle only: a file (e.g. the source GGUF) is left as it was."""
  from pijax.errors import BundleError
  victim = tmp_path / "model.gguf"
  victim.write_bytes(b"GGUF data")
  with pytest.raises(BundleError, match="not a bundle"):
    bundle_lib.write_bundle(str(victim), {"x": np.ones(2)}, {}, overwrite=True)
  assert victim.read_bytes() == b"GGUF data"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


@pytest.mark.parametrize("act,activation,asked,kind", [("silu", None, "auto", "lowbit"),
                                                       ("relu", "relu", "auto", "mlp"),
                                                       ("relu", "relu", "lowbit", "lowbit")])
def test_convert_builds_the_predictor_the_runtime_uses(tmp_path, shared_dir, monkeypatch, act,
                                                       activation, asked, kind):
  """SwiGLU runs the low-bit predictor, so convert trains no MLP predictors for it: the bundle
  holds the 4-bit sketch of its permuted gate/up rows (equal to `lowbit_params` of them), the
  manifest records the kind, `--predictor_kind=auto` at run time picks it, and the stored
  sketch decodes the tokens a rebuilt one does. ReLU families still train MLP predictors."""
  import tiny_models
  from pijax import convert as convert_mod
  from pijax.errors import ConfigError
  from pijax.offline import predictor as predictor_lib
  hf = tiny_models.make_hf_llama(hidden_act=act, seed=4)
  path = tiny_models.write_gguf(hf, tmp_path / "m.gguf", ffn_activation=activation)
  model = pijax.load(path, max_seq_len=128)
  trained = []
  real_train = convert_mod.train_predictors
  monkeypatch.setattr(convert_mod, "train_predictors",
                      lambda *a, **k: trained.append(1) or real_train(*a, **k))
  cal = tmp_path / "cal.txt"
  cal.write_text((shared_dir / "data" / "tinyshakespeare" / "input.txt").read_text()[:20000])
  opts = convert_mod.ConvertOptions(
      calibration=str(cal), out=str(tmp_path / "b"), hot_ratio=0.5, max_seq_len=128,
      max_tokens=12 * 64, chunk_len=64, ranks=(8,), epochs=1, predictor_kind=asked,
      progress=False)
  manifest = convert_mod.convert(model, opts)
  assert manifest["predictor"]["kind"] == kind
  assert bool(trained) == (kind == "mlp")
  d = model.config.hidden_size  # Placement counts the hot rows' low-bit codes on the device.
  hot = manifest["placement"]["hot_counts"]
  per_neuron = manifest["device"]["bytes_per_hot_neuron"]  # int8 rows + a scale per 32.
  assert per_neuron == 3 * d // 32 * 36 and manifest["device"]["hot_rows"] == "int8"
  assert manifest["placement"]["ffn_bytes_hot"] == sum(hot) * (
      per_neuron + (predictor_lib.hot_neuron_bytes(d, kind)))
  bundled = pijax.load(str(tmp_path / "b"), max_seq_len=128)
  sparse = bundled.sparse
  assert sparse.predictor_kind == kind
  if kind == "mlp":
    assert sparse.lowbit is None and len(sparse.predictors) == model.config.n_layers
    return
  assert not sparse.predictors and manifest["totals"]["mean_recall"] is None
  for name, rows in bundle_load.rows(bundled).items():
    want = predictor_lib.lowbit_params(rows["gate"], rows["up"])
    for key, value in want.items():
      np.testing.assert_array_equal(np.asarray(sparse.lowbit[name][key]), value)
  np.testing.assert_array_equal(sparse.cuts, sparse.thresholds)
  with pytest.raises(ConfigError, match="not MLP predictors"):
    bundled.configure_sparse("predictor", predictor_kind="mlp")
  from pijax import eval_predictors  # auto evaluates the bundle's own predictor (any family).
  rows = eval_predictors.evaluate_predictors(bundled, cal.read_text(), max_tokens=128,
                                             chunk_len=64, predictor_kind="auto")
  assert len(rows) == model.config.n_layers
  # Re-placement at load counts what will run: the hot rows' codes, or every row's (--overlap).
  from pijax.backends import hybrid as hybrid_backend
  from pijax.offline import placement as placement_lib
  seen = []
  real_place = placement_lib.place
  monkeypatch.setattr(placement_lib, "place", lambda *a, **k: seen.append(k) or real_place(*a, **k))
  bundled.configure_sparse("predictor", hot_ratio=0.5)
  bundled.configure_sparse("predictor", hot_ratio=0.5, overlap=True)
  d, f, n_layers = model.config.hidden_size, model.config.intermediate_size, model.config.n_layers
  assert [(k["predictor_ranks"], k["predictor_neuron_bytes"], k["predictor_bytes"])
          for k in seen] == [([], predictor_lib.hot_neuron_bytes(d, "lowbit"), None),
                             ([], 0, predictor_lib.lowbit_bytes(d, f) * n_layers)]
  # A corrupt low-bit bundle is one BundleError naming the array, never a KeyError later.
  tree = bundle_lib.read_checkpoint(str(tmp_path / "b"))
  cases = {"no layer": lambda t: t["lowbit"].pop("layers_1"),
           "no key": lambda t: t["lowbit"]["layers_0"].pop("up_scales"),
           "dtype": lambda t: t["lowbit"]["layers_0"].update(
               gate_codes=t["lowbit"]["layers_0"]["gate_codes"].astype(np.float32)),
           "shape": lambda t: t["lowbit"]["layers_0"].update(
               up_codes=t["lowbit"]["layers_0"]["up_codes"][:-3])}
  for name, corrupt in cases.items():
    broken = bundle_lib.jax_tree_to_numpy(tree)
    corrupt(broken)
    out = tmp_path / f"broken_{name.replace(' ', '_')}"
    bundle_lib.write_bundle(str(out), broken, manifest)
    with pytest.raises(BundleError, match="re-run pijax.convert"):
      bundle_lib.open_bundle(str(out))
  for record in ("lowbit", ["lowbit"], 3, {"kind": "foo"}):
    out = tmp_path / "bad_record"
    bundle_lib.write_bundle(str(out), tree, dict(manifest, predictor=record), overwrite=True)
    with pytest.raises(BundleError, match="predictor"):
      bundle_lib.open_bundle(str(out))
  bundled.configure_sparse("predictor")
  assert bundled.backend.spec.predictor_kind == "lowbit"
  stored = bundled.generate([1, 5, 9, 30], max_new_tokens=6, temperature=0.0).token_ids
  sparse.lowbit = None  # Rebuilt from the rows at configure time instead.
  bundled.configure_sparse("predictor")
  assert bundled.generate([1, 5, 9, 30], max_new_tokens=6, temperature=0.0).token_ids == stored


def _edited_bundle(converted, out, manifest_edit=None, tree_edit=None):
  """A copy of the converted bundle at `out` with its manifest and/or checkpoint tree edited."""
  opts, manifest = converted
  tree = bundle_lib.read_checkpoint(opts.out)
  manifest = json.loads(json.dumps(manifest))
  if manifest_edit:
    manifest_edit(manifest)
  if tree_edit:
    tree_edit(tree)
  bundle_lib.write_bundle(str(out), tree, manifest, overwrite=True)
  return str(out)


def _set(path, value):
  def edit(d):
    *head, last = path
    for k in head:
      d = d[k]
    d[last] = value
  return edit


@pytest.mark.parametrize("name, edit", [
    ("hidden inf", _set(("model", "hidden_size"), float("inf"))),
    ("hidden bool", _set(("model", "hidden_size"), True)),
    ("inter float", _set(("model", "intermediate_size"), 1536.0)),
    ("hot_count missing", lambda m: m["layers"][2].pop("hot_count")),
    ("hot_count big", _set(("layers", 2, "hot_count"), 10 ** 9)),
    ("hot_count negative", _set(("layers", 2, "hot_count"), -64)),
    ("layers string", _set(("layers",), "30")),
    ("source path list", _set(("source", "path"), ["a"])),
    ("sha256 int", _set(("source", "sha256"), 7)),
    ("version bool", _set(("version",), True)),
    ("version float", _set(("version",), 2.0)),
])
def test_bundle_manifest_with_bad_fields_is_refused(converted, tmp_path, name, edit):
  """Each bad manifest field is one BundleError, never a traceback or a silent load."""
  out = _edited_bundle(converted, tmp_path / "b", manifest_edit=edit)
  with pytest.raises(BundleError, match=r"re-run pijax.convert|re-convert"):
    bundle_lib.open_bundle(out)


def test_bundle_manifest_that_is_not_utf8_is_refused(converted, tmp_path):
  out = _edited_bundle(converted, tmp_path / "b")
  (tmp_path / "b" / bundle_lib.MANIFEST_FILE).write_bytes(b'{"format": "\xff"}')
  with pytest.raises(BundleError, match="unreadable bundle manifest"):
    bundle_lib.open_bundle(out)


@pytest.mark.parametrize("name, edit", [
    ("thresholds missing", lambda t: t.pop("thresholds")),
    ("cuts missing", lambda t: t.pop("cuts")),
    ("frequencies missing", lambda t: t.pop("frequencies")),
    ("thresholds short", lambda t: t.update(thresholds=t["thresholds"][:-1])),
    ("thresholds nan", lambda t: t.update(thresholds=np.full_like(t["thresholds"], np.nan))),
    ("frequencies shape", lambda t: t.update(frequencies=t["frequencies"][:, :-1])),
    ("ffn rows in version 2", lambda t: t.update(ffn={"layers_0": {"gate": np.ones((2, 2))}})),
])
def test_bundle_checkpoint_with_bad_arrays_is_refused(converted, tmp_path, name, edit):
  out = _edited_bundle(converted, tmp_path / "b", tree_edit=edit)
  with pytest.raises(BundleError, match="re-run pijax.convert"):
    bundle_lib.open_bundle(out)


@pytest.mark.parametrize("name", ["layer missing", "gate shape", "not a dict"])
def test_version_1_bundle_with_bad_rows_is_refused(converted, smollm2, tmp_path, name):
  def edit(tree):
    rows = bundle_lib.permute_ffn(smollm2.params, smollm2.config.n_layers, tree["perm"])
    if name == "layer missing":
      rows.pop("layers_5")
    elif name == "gate shape":
      rows["layers_2"]["gate"] = rows["layers_2"]["gate"][:, :-1]
    else:
      rows = np.ones(3, np.float32)
    tree["ffn"] = rows
  out = _edited_bundle(converted, tmp_path / "b", manifest_edit=_set(("version",), 1),
                       tree_edit=edit)
  with pytest.raises(BundleError, match="ffn rows"):
    bundle_lib.open_bundle(out)


def test_bundle_sizes_must_be_the_sources(converted, tmp_path):
  """A bundle consistent with itself but not with its source GGUF: one BundleError at load."""
  def tree_edit(tree):
    tree["perm"] = np.argsort(np.asarray(tree["perm"])[:, :-1], axis=1).astype(np.int32)
    tree["frequencies"] = np.asarray(tree["frequencies"])[:, :-1]

  def manifest_edit(manifest):
    manifest["model"]["intermediate_size"] -= 1
    for layer in manifest["layers"]:  # Still within the (edited) layer.
      layer["hot_count"] = min(layer["hot_count"], manifest["model"]["intermediate_size"])
    tree = bundle_lib.read_checkpoint(converted[0].out)
    tree_edit(tree)
    manifest["perm_sha256"] = bundle_lib.perm_sha256(tree["perm"])

  out = _edited_bundle(converted, tmp_path / "b", manifest_edit=manifest_edit,
                       tree_edit=tree_edit)
  bundle_lib.open_bundle(out)  # Consistent with itself...
  with pytest.raises(BundleError, match="intermediate_size 1535, but its source has"):
    pijax.load(out)  # ...but not with the source.


def test_bfloat16_load_of_a_bundle_gathers_f32_rows(converted, smollm2):
  """The host part reads f32 rows whatever the compute dtype: gathered from an f32 source."""
  opts, _ = converted
  model = pijax.load(opts.out, dtype="bfloat16", max_seq_len=64)
  perm = model.sparse.perm
  want = bundle_lib.permute_ffn(smollm2.params, smollm2.config.n_layers, perm)
  got = bundle_load.rows(model)["layers_12"]["down"]
  assert got.dtype == np.float32
  np.testing.assert_array_equal(got, want["layers_12"]["down"])
