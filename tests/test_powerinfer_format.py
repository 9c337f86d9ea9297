"""PowerInfer's own files (magic b"PWRI", fc1/fc2 predictors, ffn_down_t, its .gpuidx placement),
written at the tiny shape by scripts/make_synthetic_gguf.py --format powerinfer: they load and
run dense like a plain GGUF of the same weights, their own tensors and KVs read back exactly
(gguf.GGUFReader on a copy with GGUF's magic is the oracle), and bad files give one clear
error."""

import os
import pathlib
import re
import subprocess
import sys

import gguf
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import synthetic_powerinfer as spi  # noqa: E402

import pijax  # noqa: E402
from pijax.errors import GGUFError  # noqa: E402
from pijax.formats import gguf as gguf_io  # noqa: E402
from pijax.formats import loader, powerinfer  # noqa: E402

CONFIG = "--config=" + str(ROOT / "configs" / "smollm2_135m.py")
IDS = [1, 5, 9, 300, 42, 7]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """{(type, activation): path} of tiny PowerInfer files, written once."""
  folder = tmp_path_factory.mktemp("powerinfer")
  out = {}
  for qtype, activation in (("Q4_0", "relu"), ("F16", "relu"), ("Q8_0", "relu"),
                            ("Q4_0", "drelu")):
    path = str(folder / f"tiny-{activation}.{qtype}.gguf")
    spi.write(path, shape="tiny", qtype=qtype, activation=activation)
    out[qtype, activation] = path
  return out


def _oracle(path, tmp_path) -> gguf.GGUFReader:
  """gguf.GGUFReader (which refuses PWRI) on a copy with GGUF's magic."""
  data = bytearray(pathlib.Path(path).read_bytes())
  assert data[:4] == b"PWRI"
  data[:4] = b"GGUF"
  copy = tmp_path / (pathlib.Path(path).name + ".as-gguf")
  copy.write_bytes(bytes(data))
  return gguf.GGUFReader(str(copy))


# --------------------------------------------------------------------------- layout, read back
@pytest.mark.parametrize("key", [("Q4_0", "relu"), ("F16", "relu"), ("Q8_0", "relu"),
                                 ("Q4_0", "drelu")])
def test_file_has_powerinfer_layout_and_reads_back_exactly(files, tmp_path, key):
  path = files[key]
  qtype, activation = key
  oracle = _oracle(path, tmp_path)
  theirs = {t.name: t for t in oracle.tensors}
  arch = oracle.fields["general.architecture"].contents()
  assert arch == ("bamboo" if activation == "drelu" else "llama")
  # PowerInfer's converters rename ffn_down: only the transposed copy is in the file.
  assert not any(n.endswith(".ffn_down.weight") for n in theirs)
  ptype = {"Q4_0": "Q4_0", "F16": "F16", "Q8_0": "Q5_0"}[qtype]
  assert theirs["output.weight"].tensor_type.name == ("F16" if qtype == "F16" else "Q8_0")
  for i, rank in enumerate((32, 64)):  # Ranks differ per layer.
    # ggml ne order: fc1 {n_embd, r}, fc2 {r, n_ff}, ffn_down_t {n_embd, n_ff}.
    assert list(theirs[f"blk.{i}.fc1.weight"].shape) == [128, rank]
    assert list(theirs[f"blk.{i}.fc2.weight"].shape) == [rank, 352]
    assert list(theirs[f"blk.{i}.ffn_down_t.weight"].shape) == [128, 352]
    assert theirs[f"blk.{i}.fc1.weight"].tensor_type.name == ptype
    assert theirs[f"blk.{i}.ffn_down_t.weight"].tensor_type.name == qtype

  preds = powerinfer.read_predictors(path)
  field = oracle.fields[powerinfer.THRESHOLD_KEY]
  assert field.types == [gguf.GGUFValueType.FLOAT32]
  assert preds.threshold == float(field.parts[-1][0]) == np.float32(spi.DEFAULT_THRESHOLD)
  assert preds.ranks == (32, 64)
  for i, layer in enumerate(preds.layers):
    for m in (layer.fc1, layer.fc2):
      t = theirs[m.name]
      assert m.ggml_type == t.tensor_type.name
      assert m.shape == tuple(int(d) for d in reversed(t.shape))
      assert bytes(np.ascontiguousarray(m.data)) == bytes(np.ascontiguousarray(t.data))
      np.testing.assert_array_equal(
          m.f32(), gguf.quants.dequantize(t.data, t.tensor_type).reshape(m.shape))
  assert preds.nbytes == sum(int(theirs[n].n_bytes) for n in theirs if ".fc" in n)
  for i, down in enumerate(powerinfer.read_down_t(path)):
    t = theirs[f"blk.{i}.ffn_down_t.weight"]
    assert down.shape == (352, 128)
    assert bytes(np.ascontiguousarray(down.data)) == bytes(np.ascontiguousarray(t.data))


def test_our_reader_lists_the_file_and_a_dense_view(files, tmp_path):
  """Every tensor the file holds reads as gguf.GGUFReader reads it; the derived dense
  ffn_down of each layer is the transpose of ffn_down_t, F32 for block types (no block format
  holds the transpose exactly) and an F16 view for F16 files."""
  for key, view_type in ((("Q4_0", "relu"), "F32"), (("F16", "relu"), "F16")):
    path = files[key]
    reader, metadata = gguf_io.open_gguf(path)
    assert reader.powerinfer and reader.magic == b"PWRI"
    oracle = {t.name: t for t in _oracle(path, tmp_path).tensors}
    own = [t for t in reader.tensors if t.source is None]
    assert [t.name for t in own] == list(oracle)
    for t in own:
      assert bytes(np.ascontiguousarray(t.data)) == bytes(np.ascontiguousarray(
          oracle[t.name].data))
    views = {t.name: t for t in reader.tensors if t.source is not None}
    assert sorted(views) == ["blk.0.ffn_down.weight", "blk.1.ffn_down.weight"]
    for name, view in views.items():
      assert view.tensor_type.name == view_type and list(view.shape) == [352, 128]
      src = oracle[name.replace("ffn_down", "ffn_down_t")]
      want = gguf.quants.dequantize(src.data, src.tensor_type).reshape(352, 128).T
      np.testing.assert_array_equal(loader.dequantize(view, path), want)
      np.testing.assert_array_equal(loader.dequantize(view, path, rows=(5, 9)), want[5:9])
  # BF16 (converters write F32/F16, but a file may hold it): its rows are bytes, so the view is
  # read through the dequantizer like a block type.
  rng = np.random.default_rng(3)
  down = rng.standard_normal((352, 128)).astype(np.float32)
  bf16 = str(tmp_path / "bf16.gguf")
  _with_tensor(files["F16", "relu"], bf16, "blk.1.ffn_down_t.weight",
               gguf.quants.quantize(down, gguf.GGMLQuantizationType.BF16),
               gguf.GGMLQuantizationType.BF16)
  reader, _ = gguf_io.open_gguf(bf16)
  view = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
  assert view.tensor_type.name == "F32" and view.source.tensor_type.name == "BF16"
  want = gguf.quants.dequantize(gguf.quants.quantize(down, gguf.GGMLQuantizationType.BF16),
                                gguf.GGMLQuantizationType.BF16).T
  np.testing.assert_array_equal(loader.dequantize(view, bf16), want)
  loader.read_gguf(bf16)


# ---------------------------------------------------------------------------------- dense runs
@pytest.mark.parametrize("key", [("Q4_0", "relu"), ("F16", "relu"), ("Q4_0", "drelu")])
def test_dense_run_equals_a_plain_gguf_of_the_same_weights(files, tmp_path, key):
  """Same prompt logits as the plain twin (ffn_down = ffn_down_t transposed, exact: F32 for a
  block type, F16 for F16) on the XLA and the host backend; host and XLA agree as the other
  host tests ask."""
  path = files[key]
  twin = str(tmp_path / "twin.gguf")
  spi.write_dense_twin(path, twin, down_type="F16" if key[0] == "F16" else "F32")
  # The twin is a `llama` file (a bamboo source's keys renamed): the bamboo family is checked
  # against llama's.
  arch = {"relu": "llama", "drelu": "bamboo"}[key[1]]
  assert gguf_io.open_gguf(path)[1]["general.architecture"] == arch
  assert gguf_io.open_gguf(twin)[1]["general.architecture"] == "llama"
  pw, plain = pijax.load(path, max_seq_len=32), pijax.load(twin, max_seq_len=32)
  family = {"relu": "reglu", "drelu": "drelu"}[key[1]]
  assert pw.config.ffn_family == plain.config.ffn_family == family
  ref = plain.prompt_logits(IDS)
  np.testing.assert_array_equal(pw.prompt_logits(IDS), ref)
  for model in (pw, plain):
    assert model.configure_host_weights("gguf", dot="f32") == "gguf"
  host = pw.prompt_logits(IDS)
  np.testing.assert_array_equal(host, plain.prompt_logits(IDS))
  np.testing.assert_allclose(host, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("key", [("Q4_0", "relu"), ("Q4_0", "drelu")])
def test_one_token_logits_equal_a_numpy_forward(files, key):
  """At position 0 attention is W_o W_v h, so a NumPy forward over the file's own tensors
  (ffn_down_t, not the derived view) is an oracle for the whole model: ReGLU `llama` and dReLU
  `bamboo`."""
  path = files[key]
  tokens = np.array([3, 77, 400])
  want, layers = spi.reference_forward(path, tokens)
  assert all((act == 0).mean() > 0.8 for _, act in layers)  # The file's ReLU sparsity.
  model = pijax.load(path, max_seq_len=16)
  got = np.stack([np.asarray(model.prompt_logits([int(t)]))[-1] for t in tokens])
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_generate_cli_runs_a_powerinfer_file_dense(files):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  for flags in ([], ["--host_weights=gguf"]):
    proc = subprocess.run([sys.executable, "-m", "pijax.generate", CONFIG,
                           f"--model={files['Q4_0', 'relu']}", "--prompt=ab",
                           "--max_new_tokens=3", "--temperature=0", *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "new tokens: 3" in proc.stderr + proc.stdout


# -------------------------------------------------------------------------- predictors' quality
def test_predictors_find_the_active_neurons(files):
  """The generator's analytic predictors on the file's own activations (deterministic seeds):
  ~90% of neurons inactive, most active ones predicted, few predicted in vain."""
  for key in (("Q4_0", "relu"), ("F16", "relu")):
    stats = spi.measure(files[key], n_tokens=128)
    assert len(stats) == 2
    for s in stats:
      assert 0.85 < s.true_sparsity < 0.95, s
      assert s.recall > (0.93 if key[0] == "Q4_0" else 0.98), s
      assert s.precision > 0.6 and s.predicted_sparsity > 0.8, s
  # dReLU: the predictor finds gate > 0; the truly active set also needs up > 0.
  for s in spi.measure(files["Q4_0", "drelu"], n_tokens=128):
    assert s.true_sparsity > 0.93 and s.recall > 0.93, s


def test_predictor_logits_reference():
  rng = np.random.default_rng(0)
  fc1, fc2 = rng.standard_normal((8, 16)), rng.standard_normal((24, 8))
  x = rng.standard_normal((3, 16))
  want = np.stack([fc2 @ np.maximum(fc1 @ row, 0) for row in x])
  np.testing.assert_allclose(powerinfer.predictor_logits(fc1, fc2, x), want, rtol=1e-5)


# ---------------------------------------------------------------------------------- placement
def test_gpuidx_round_trip(files, tmp_path):
  path = str(tmp_path / "m.gguf")
  _, design = spi.write(path, shape="tiny")
  per_neuron = spi.neuron_bytes(path)
  assert per_neuron == 3 * 4 * 18  # Gate, up and down_t rows: 128 values of Q4_0 each.
  budget = 150 * per_neuron + 7
  out, masks = spi.write_gpuidx(path, design, budget)
  assert out == path + ".generated.gpuidx" == powerinfer.gpuidx_path(path)
  assert pathlib.Path(out).read_bytes()[:4] == b"PWRI"
  index = powerinfer.read_gpuidx(out, n_layers=2, ffn=352)
  assert index.vram_capacity_bytes == budget and sum(index.hot_counts) == 150
  hot = np.concatenate(design.hotness)[np.concatenate(index.gpu_masks)]
  cold = np.concatenate(design.hotness)[~np.concatenate(index.gpu_masks)]
  assert hot.min() >= cold.max()  # The neurons that fire most often.
  oracle = _oracle(out, tmp_path)
  assert oracle.fields["general.architecture"].contents() == "generic.gpu_index"
  assert oracle.fields["split.vram_capacity"].types == [gguf.GGUFValueType.UINT64]
  # PowerInfer reads the tensors by position: gpu_idx, gpu_bucket per layer, in order.
  assert [t.name for t in oracle.tensors] == [
      "blk.0.gpu_idx", "blk.0.gpu_bucket", "blk.1.gpu_idx", "blk.1.gpu_bucket"]
  for i in range(2):
    idx, bucket = oracle.tensors[2 * i], oracle.tensors[2 * i + 1]
    assert idx.tensor_type == bucket.tensor_type == gguf.GGMLQuantizationType.I32
    np.testing.assert_array_equal(np.array(idx.data), index.gpu_masks[i].astype(np.int32))
    np.testing.assert_array_equal(np.array(bucket.data), index.gpu_buckets[i])
    np.testing.assert_array_equal(masks[i], index.gpu_masks[i])
  with pytest.raises(GGUFError, match=r"generic\.gpu_index.*PowerInfer's GPU placement file"):
    pijax.load(out)
  # An empty placement (budget 0) writes empty buckets and reads back.
  out, _ = spi.write_gpuidx(path, design, 0)
  assert powerinfer.read_gpuidx(out).hot_counts == (0, 0)


def test_gpuidx_of_another_model_is_refused(files, tmp_path):
  out = str(tmp_path / "x.gpuidx")
  powerinfer.write_gpuidx(out, [np.arange(64) % 3 == 0] * 2, 1000)
  with pytest.raises(GGUFError, match="places 64 neurons but the model has 352"):
    powerinfer.read_gpuidx(out, ffn=352)
  with pytest.raises(GGUFError, match="2 layers but the model has 3"):
    powerinfer.read_gpuidx(out, n_layers=3)
  with pytest.raises(GGUFError, match="not a PowerInfer placement file"):
    powerinfer.read_gpuidx(files["Q4_0", "relu"])
  bad = str(tmp_path / "bad.gpuidx")
  spi.rewrite(out, bad, lambda t: [(t.name, np.array(t.data)[::-1].copy(), None)]
              if t.name == "blk.1.gpu_bucket" else [spi._copied(t)])
  with pytest.raises(GGUFError, match="'blk.1.gpu_bucket' is not the sorted ids"):
    powerinfer.read_gpuidx(bad)


# --------------------------------------------------------------------------------- bad inputs
def _with_tensor(src, dst, name, data, raw=None):
  """`src` with tensor `name` replaced (None: dropped)."""
  def edit(t):
    if t.name != name:
      return [spi._copied(t)]
    return [] if data is None else [(name, data, raw)]
  spi.rewrite(src, dst, edit)
  return dst


def test_bad_powerinfer_files_give_one_clear_error(files, tmp_path):
  src = files["F16", "relu"]
  data = pathlib.Path(src).read_bytes()
  cases = {}
  (tmp_path / "cut.gguf").write_bytes(data[:len(data) - 1000])
  cases["cut.gguf"] = "truncated or corrupt: tensor 'output.weight'"
  (tmp_path / "magic.gguf").write_bytes(b"PWRX" + data[4:])
  cases["magic.gguf"] = "not a GGUF file (magic b'PWRX'"
  rank = np.zeros((352, 48), np.float16)  # fc2 of rank 48 after an fc1 of rank 32.
  _with_tensor(src, str(tmp_path / "fc2.gguf"), "blk.0.fc2.weight", rank)
  cases["fc2.gguf"] = ("'blk.0.fc2.weight' has shape (352, 48), expected (352, 32)")
  _with_tensor(src, str(tmp_path / "fc1.gguf"), "blk.1.fc1.weight",
               np.zeros((64, 96), np.float16))
  cases["fc1.gguf"] = "'blk.1.fc1.weight' has shape (64, 96), expected (rank, 128)"
  _with_tensor(src, str(tmp_path / "half.gguf"), "blk.1.fc2.weight", None)
  cases["half.gguf"] = "'blk.1.fc1.weight' is there but 'blk.1.fc2.weight' is missing"
  _with_tensor(src, str(tmp_path / "down.gguf"), "blk.0.ffn_down_t.weight", None)
  cases["down.gguf"] = "'blk.0.ffn_down.weight' is missing (PowerInfer files hold it as"
  for name, needle in cases.items():
    path = str(tmp_path / name)
    with pytest.raises(GGUFError) as err:
      loader.read_gguf(path)
    message = str(err.value)
    assert needle in message and path in message and "\n" not in message, message


def test_predictor_problems_are_named(files, tmp_path):
  src = files["Q4_0", "relu"]
  nan = str(tmp_path / "nan.gguf")
  spi.rewrite(src, nan, kv={powerinfer.THRESHOLD_KEY: (float("nan"),
                                                       gguf.GGUFValueType.FLOAT32)})
  with pytest.raises(GGUFError, match="powerinfer.sparse_threshold=nan must be a finite"):
    powerinfer.read_predictors(nan)
  text = str(tmp_path / "text.gguf")
  spi.rewrite(src, text, kv={powerinfer.THRESHOLD_KEY: ("0.5", gguf.GGUFValueType.STRING)})
  with pytest.raises(GGUFError, match="holds a STRING value where GGUF specifies a number"):
    loader.read_gguf(text)
  q8_1 = str(tmp_path / "q8_1.gguf")  # A type gguf.quants cannot read: Q8_1 blocks.
  _with_tensor(src, q8_1, "blk.0.fc1.weight", np.zeros((32, 4 * 40), np.uint8),
               gguf.GGMLQuantizationType.Q8_1)
  loader.read_gguf(q8_1)  # The dense path does not read the predictors.
  with pytest.raises(GGUFError, match="'blk.0.fc1.weight' has type Q8_1"):
    powerinfer.read_predictors(q8_1)
  plain = str(tmp_path / "plain.gguf")
  spi.write_dense_twin(src, plain)
  with pytest.raises(GGUFError, match="not a PowerInfer file"):
    powerinfer.read_predictors(plain)
  bare = str(tmp_path / "bare.gguf")
  spi.rewrite(src, bare, lambda t: [] if ".fc" in t.name else [spi._copied(t)])
  pijax.load(bare, max_seq_len=16)  # Runs dense without predictors.
  with pytest.raises(GGUFError, match="layer 0 has no PowerInfer predictor"):
    powerinfer.read_predictors(bare)


@pytest.mark.parametrize("case", ["gpuidx", "truncated"])
def test_generate_cli_refuses_in_one_line(files, tmp_path, case):
  path = files["Q4_0", "relu"]
  if case == "gpuidx":
    _, design = spi.write(str(tmp_path / "m.gguf"), shape="tiny")
    path, _ = spi.write_gpuidx(str(tmp_path / "m.gguf"), design, 10_000)
    needle = "PowerInfer's GPU placement file"
  else:
    data = pathlib.Path(path).read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:len(data) // 2])
    needle = "truncated"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", "pijax.generate", CONFIG, f"--model={path}",
                         "--prompt=ab", "--max_new_tokens=1"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
  assert len(lines) == 1 and needle in lines[0] and str(path) in lines[0], proc.stderr


# -------------------------------------------------------------------------------- generator CLI
def test_generator_cli(tmp_path):
  script = str(ROOT / "scripts" / "make_synthetic_gguf.py")
  out = tmp_path / "p.gguf"
  proc = subprocess.run([sys.executable, script, "--format", "powerinfer", "--shape", "tiny",
                         "--out", str(out), "--measure_tokens", "64", "--gpuidx_bytes", "20000"],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  assert re.search(r"mean  recall 0\.9\d+  precision 0\.\d+  predicted sparsity 0\.8\d+",
                   proc.stdout), proc.stdout
  assert "92 GPU neurons for 20000 bytes" in proc.stdout, proc.stdout
  assert out.read_bytes()[:4] == b"PWRI" and not list(tmp_path.glob("*.tmp"))
  for args, needle in ((["--format", "powerinfer", "--activation", "silu"],
                        "PowerInfer runs only ReLU families"),
                       (["--threshold", "0.5"], "--threshold need --format powerinfer"),
                       (["--type", "F16"], "--type F16 is for --format powerinfer")):
    proc = subprocess.run([sys.executable, script, "--shape", "tiny", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
