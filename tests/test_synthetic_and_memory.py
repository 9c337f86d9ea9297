"""The synthetic 7B-shaped GGUF generator (run here at a tiny shape) and host-path memory: a run on
host weights never reads the dense f32 tree."""

import json
import os
import pathlib
import subprocess
import sys

import gguf
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import make_synthetic_gguf as synthetic  # noqa: E402


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_synthetic_blocks_have_the_asked_statistics(qtype):
  rng = np.random.default_rng(0)
  blocks = synthetic.random_blocks(rng, 64, 256, qtype)
  w = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, qtype)).reshape(64, 256)
  assert abs(w.std() - 0.02) < 0.002 and abs(w.mean()) < 0.002
  assert len(np.unique(w)) > 10  # Random codes, not a constant.


def test_synthetic_drelu_file_runs_sparse_on_host(tmp_path):
  """The tiny-shape file loads (metadata, tokenizer, every tensor), runs on host weights, and its
  dReLU FFN leaves about 75% of neurons inactive by construction (gate > 0 and up > 0 each
  about half the time); gate-first sparse decoding equals the dense run in f32 (ReLU zeros are
  skipped exactly; the neuron-major down rows are re-quantized to Q8_0, so close, not bitwise)."""
  import pijax
  path = tmp_path / "syn.gguf"
  size = synthetic.write(str(path), shape="tiny", qtype="Q4_1", activation="drelu")
  assert size == path.stat().st_size and not (tmp_path / "syn.gguf.tmp").exists()
  model = pijax.load(path, max_seq_len=64)
  assert model.config.ffn_family == "drelu" and model.config.n_layers == 2
  assert model.configure_host_weights("auto", dot="f32") == "gguf"
  ids = [1, 5, 9, 300, 42]
  dense = model.generate(ids, max_new_tokens=6, temperature=0.0)
  dense_logits = model.backend.decoder.forward(model.backend.decoder.new_cache(1, 8),
                                               np.asarray([ids]), 0)
  model.configure_host_weights("auto", gate_sparse=True, dot="f32")
  dec = model.backend.decoder
  sparse_logits = dec.forward(dec.new_cache(1, 8), np.asarray([ids]), 0)
  assert 0.15 < dec.last_active.mean() < 0.35
  np.testing.assert_allclose(sparse_logits, dense_logits, rtol=1e-2,
                             atol=1e-2 * np.abs(dense_logits).max())
  assert not model.params_loaded
  assert len(model.generate(ids, max_new_tokens=6, temperature=0.0).token_ids) == \
      len(dense.token_ids)


def test_contribution_rule_on_host_weights(tmp_path, shared_dir):
  """--sparse=contribution through the host backend on the tiny dReLU file: gate cuts 0,
  contribution cuts calibrated on text for a sparsity above dReLU's own (~75%), so fewer
  down rows than exact zeros alone while every g > 0 still reads its up row; the bench's
  dense/sparse switch keeps the contribution cuts; refused without the gate-first FFN;
  `Model.configure_sparse` takes the same words (bundle modes refused on a GGUF)."""
  import pijax
  from pijax import bench
  from pijax.errors import ConfigError
  path = tmp_path / "syn.gguf"
  synthetic.write(str(path), shape="tiny", qtype="Q4_1", activation="drelu")
  model = pijax.load(path, max_seq_len=64)
  cal = str(shared_dir / "data" / "tinyshakespeare" / "input.txt")
  ids = np.asarray([[1, 5, 9, 300, 42]])
  model.configure_host_weights("auto", gate_sparse=True, dot="f32")
  exact = model.backend.decoder
  exact.forward(exact.new_cache(1, 8), ids, 0)
  exact_active, exact_passed = exact.last_active.mean(), exact.last_passed.copy()
  model.configure_host_weights("auto", gate_sparse=True, dot="f32", gate_rule="contribution",
                               gate_sparsity=0.9, calibration_file=cal)
  dec = model.backend.decoder
  cuts = dec.contribution_cuts
  assert dec.gate_cuts == [0.0, 0.0] and all(c > 0 for c in cuts)
  dec.forward(dec.new_cache(1, 8), ids, 0)
  assert dec.last_active.mean() < 0.8 * exact_active
  # Layer 0 sees the same input, so the same gates pass; layer 1 an input a little changed.
  assert dec.last_passed[0] == exact_passed[0]
  assert dec.last_passed[1] == pytest.approx(exact_passed[1], abs=0.05)
  gate, dense = bench.run(model, n_prompt=0, n_gen=4, reps=1, threads=1, interleave_dense=True)
  assert dec.contribution_cuts == cuts and gate["ffn_sparsity"] > 1 - 0.8 * exact_active
  assert gate["mode"] == model.sparse_mode == "contribution"
  assert dense["ffn_sparsity"] == 0.0
  for rule, sparse in (("contribution", False), ("nope", True)):
    with pytest.raises(ConfigError, match="--sparse=gate or --sparse=contribution"):
      model.configure_host_weights("auto", gate_sparse=sparse, gate_rule=rule)
  # The library's one vocabulary: configure_sparse("contribution") is the same backend.
  model.configure_sparse("contribution", gate_sparsity=0.5, dot="f32", calibration_file=cal)
  assert model.sparse_mode == "contribution" and model.backend.decoder.contribution_cuts
  for mode in ("oracle", "predictor"):
    with pytest.raises(ConfigError, match="bundle"):
      model.configure_sparse(mode)


def test_bench_interleaves_dense_and_gate_sparse_decode(tmp_path):
  """`pijax.bench --sparse=gate --interleave_dense` on the tiny dReLU file: a gate row and a
  dense row from one process, the ratio on the gate row, bytes that count every up row read
  (about half the neurons pass the gate, a quarter are computed); refused without
  --sparse=gate (exit 2, one line)."""
  path = tmp_path / "syn.gguf"
  synthetic.write(str(path), shape="tiny", qtype="Q4_1", activation="drelu")
  bench = [sys.executable, "-m", "pijax.bench", "-m", str(path), "-p", "0", "-n", "6", "-r", "2",
           "-t", "1"]
  proc = subprocess.run(bench + ["--sparse=gate", "--interleave_dense", "--profile_layers",
                                 "-o", "json"],
                        capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-2000:]
  gate, dense = json.loads(proc.stdout)
  assert (gate["mode"], dense["mode"]) == ("gate", "off")
  # --profile_layers: each mode's microseconds per layer and token, every phase counted, and
  # together less than a token takes (the embedding, final norm and logits are outside).
  from host_ops import decoder as decoder_lib
  for row in (gate, dense):
    assert list(row["layer_us"]) == list(decoder_lib.PHASES)
    # Every phase counted but the predictor's, which only --sparse=predictor runs.
    assert row["layer_us"]["predictor"] == 0
    assert all(us > 0 for phase, us in row["layer_us"].items() if phase != "predictor")
  assert gate["reps"] == dense["reps"] == 2 and dense["ffn_sparsity"] == 0.0
  assert 0.6 < gate["ffn_sparsity"] < 0.85
  assert gate["vs_dense"] == pytest.approx(gate["t_s_mean"] / dense["t_s_mean"])
  assert dense["weight_bytes_per_token"] == dense["dense_weight_bytes_per_token"]
  import pijax
  model = pijax.load(path, max_seq_len=64)
  model.configure_host_weights("auto", gate_sparse=True, dot="int8")
  dec = model.backend.decoder
  dec.forward(dec.new_cache(1, 8), np.asarray([[1, 5, 9, 300, 42]]), 0)
  for row in (gate, dense):
    assert sum(row["layer_us"].values()) * dec.n_layers < 1e6 / row["t_s_mean"]
  active = 1 - gate["ffn_sparsity"]
  passed_over_active = dec.read_sums[1] / dec.read_sums[0]
  assert 1.5 < passed_over_active < 2.6  # dReLU: up rows for g > 0, down rows for u > 0 too.
  # Gate rows and attention in full, up rows for the passed neurons, down rows for the active.
  want = dec.bytes_per_token() - dec.ffn_bytes_per_token() + dec.ffn_bytes_per_token(
      active, active * passed_over_active)
  assert gate["weight_bytes_per_token"] == pytest.approx(want, rel=0.05)
  proc = subprocess.run(bench + ["--interleave_dense"], capture_output=True, text=True,
                        timeout=600, cwd=ROOT)
  assert proc.returncode == 2 and "--interleave_dense" in proc.stderr
  assert "Traceback" not in proc.stderr and proc.stderr.strip().count("\n") == 0
  # A dense run alone profiles too (its key was once looked up as the interleaved dense one).
  proc = subprocess.run(bench + ["--profile_layers", "-o", "json"], capture_output=True,
                        text=True, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-2000:]
  (alone,) = json.loads(proc.stdout)
  assert alone["mode"] == "off" and list(alone["layer_us"]) == list(decoder_lib.PHASES)
  assert all(us > 0 for phase, us in alone["layer_us"].items() if phase != "predictor")
  # --profile_layers times the host layer loop: refused on the f32 XLA path, one line.
  proc = subprocess.run(bench + ["--profile_layers", "--host_weights=off"], capture_output=True,
                        text=True, timeout=600, cwd=ROOT)
  assert proc.returncode == 2 and "--profile_layers" in proc.stderr
  assert "Traceback" not in proc.stderr and proc.stderr.strip().count("\n") == 0
  # Q8_0 down rows (re-quantized): 34 bytes per 32 weights of an active neuron, against the
  # default file layout's 16 plus 4 for every neuron's scales.
  proc = subprocess.run(bench + ["--sparse=gate", "--gate_down=q8_0", "-o", "json"],
                        capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-2000:]
  (q8,) = json.loads(proc.stdout)
  down = sum(layer.down.shape[0] * layer.down.shape[1] for layer in dec.layers)
  saved = q8["dense_weight_bytes_per_token"] - q8["weight_bytes_per_token"]
  assert q8["ffn_sparsity"] == pytest.approx(gate["ffn_sparsity"], abs=0.05)
  assert saved == pytest.approx(
      dense["dense_weight_bytes_per_token"] - want + down * 4 / 32
      - (1 - q8["ffn_sparsity"]) * down * 18 / 32, rel=0.1)
  proc = subprocess.run(bench + ["--gate_down=q4_1"], capture_output=True, text=True,
                        timeout=600, cwd=ROOT)
  assert proc.returncode == 2 and "--gate_down" in proc.stderr  # Removed: absl's enum refuses it.
  assert "Traceback" not in proc.stderr
  proc = subprocess.run(bench + ["--gate_down=q8_0"], capture_output=True, text=True,
                        timeout=600, cwd=ROOT)
  assert proc.returncode == 2 and "--gate_down" in proc.stderr and "--sparse=gate" in proc.stderr
  assert "Traceback" not in proc.stderr and proc.stderr.strip().count("\n") == 0
  # The file's own Q4_1 blocks (--gate_down=file): dReLU's exact zeros skipped with nothing
  # rounded again, so a decode step equals the dense one up to f32 summation order; bytes:
  # 16 per 32 weights of an active neuron plus 4 for the scales.
  tokens = np.asarray([[1, 5, 9, 300, 42]])
  model.configure_host_weights("auto", dot="int8")
  dec = model.backend.decoder
  cid = dec.new_cache(1, 8)
  want_logits = [dec.forward(cid, tokens, 0), dec.forward(cid, np.asarray([[7]]), 5)]
  model.configure_host_weights("auto", gate_sparse=True, dot="int8", gate_down="file")
  dec = model.backend.decoder
  assert dec.down_format == "file" and model.sparse_mode == "gate"
  cid = dec.new_cache(1, 8)
  for want, got in zip(want_logits, [dec.forward(cid, tokens, 0),
                                     dec.forward(cid, np.asarray([[7]]), 5)]):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
  active = dec.last_active.mean()
  assert 0.1 < active < 0.5
  passed = dec.last_passed.mean()
  assert dec.ffn_bytes_per_token(active, passed) == pytest.approx(
      dec.ffn_bytes_per_token(0.0, passed) + active * down // 32 * 16, abs=1)
  assert dec.ffn_bytes_per_token(0.0, 0.0) == pytest.approx(
      sum(layer.gate.file_bytes() for layer in dec.layers) + down // 32 * 4, abs=1)


def test_synthetic_cli_refuses_a_missing_folder(tmp_path):
  proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_synthetic_gguf.py"),
                         "--out", str(tmp_path / "nope" / "x.gguf"), "--shape", "tiny"],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
  assert "no folder" in proc.stderr and "Traceback" not in proc.stderr
  for args, message in (([str(tmp_path)], "not a folder"), ([str(tmp_path) + os.sep], "not a folder"),
                        ([str(tmp_path / "s.gguf"), "--seed", "-1"], "--seed=-1"),
                        (["/proc/x.gguf"], "nothing was written")):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_synthetic_gguf.py"),
                           "--shape", "tiny", "--out", *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)
    assert len(proc.stderr.strip().splitlines()) == 1
  assert list(tmp_path.iterdir()) == []  # No .tmp or partial file left.


@pytest.mark.parametrize("args,message", [(["-f", "/nonexistent"], "cannot read"),
                                          (["-f", "/bin/sh"], "cannot read"),
                                          (["-f", "x", "-c", "3"], "must be even"),
                                          (["-f", "x", "--chunks", "0"], "must be >= 1")])
def test_decode_quality_bad_arguments(args, message):
  proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "decode_quality.py"), *args],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and message in proc.stderr, proc.stderr
  assert len(proc.stderr.strip().splitlines()) == 1


def test_dense_params_are_read_on_first_use(tmp_path):
  import pijax
  import tiny_models
  path = tiny_models.write_random_quantized_gguf(tmp_path / "m.gguf")
  model = pijax.load(path, max_seq_len=32)
  assert not model.params_loaded
  model.configure_host_weights("gguf")
  model.generate([0, 5], max_new_tokens=3, temperature=0.0)
  assert not model.params_loaded  # Host weights: the f32 tree is never read.
  model.configure_host_weights("off")
  model.generate([0, 5], max_new_tokens=3, temperature=0.0)
  assert model.params_loaded


def _host_run_peak_kb(path) -> int:
  """Peak RSS (kB) of loading `path` on host weights and decoding 4 tokens, in a fresh process."""
  # VmHWM (this process's peak RSS, reset by exec), not ru_maxrss: a child started by fork +
  # exec reports the parent's peak there (5.5 GB from inside a long pytest run).
  code = ("import re, pijax; m = pijax.load(%r, max_seq_len=512); "
          "assert m.configure_host_weights('auto') == 'gguf'; "
          "m.generate('The capital of France is', max_new_tokens=4, temperature=0.0); "
          "hwm = re.search(r'VmHWM:\\s*(\\d+)', open('/proc/self/status').read()).group(1); "
          "print(m.params_loaded, hwm)" % str(path))
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  loaded, peak_kb = proc.stdout.split()
  assert loaded == "False"  # Host weights: the f32 tree is never read.
  return int(peak_kb)


@pytest.mark.slow
def test_host_run_of_smollm2_peak_rss(smollm2_path):
  """SmolLM2 on host weights: 1.30 GB when the f32 tree was read eagerly, 0.84 GB with
  gguf.GGUFReader's per-token views; ~0.63 GB with our header reader, file pages released
  after copying and KV pages resident only when written; ~0.52 GB now (sampler compiled apart
  with XLA's loop emitters, freed heap trimmed after the build; imports alone ~0.27 GB). A
  fresh clone's CI run read 603,000 kB (numba compiling what its cache lacked). A memory
  bound, not a timing."""
  peak_kb = _host_run_peak_kb(smollm2_path)
  assert peak_kb < 680_000, f"peak RSS {peak_kb / 1024:.0f} MB"


@pytest.mark.slow
def test_host_run_of_gemma3_peak_rss(gemma3_path):
  """Gemma 3 270M (262k-token vocabulary) on host weights: 1.19 GB with gguf.GGUFReader,
  ~0.84 GB with our header reader, ~0.74 GB now. A memory bound, not a timing."""
  peak_kb = _host_run_peak_kb(gemma3_path)
  assert peak_kb < 840_000, f"peak RSS {peak_kb / 1024:.0f} MB"


@pytest.mark.parametrize("weights", ["gguf", "off"])
def test_nan_scales_in_a_late_tensor_are_a_clear_error(tmp_path, weights):
  """0xFF bytes over a late tensor (f16 scales become NaN): a GGUFError naming the tensor on
  the host path (at configure) and on the XLA path (when the dense tree is first read), never
  a ZeroDivisionError from a kernel or silent NaN logits."""
  import pijax
  import tiny_models
  from pijax.errors import GGUFError
  path = tiny_models.write_random_quantized_gguf(tmp_path / "m.gguf")
  reader = gguf.GGUFReader(str(path))
  tensor = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
  start, size = int(tensor.data_offset), int(tensor.n_bytes)
  del reader
  with open(path, "r+b") as fh:
    fh.seek(start)
    fh.write(b"\xff" * size)
  model = pijax.load(path, max_seq_len=32)
  with pytest.raises(GGUFError, match="blk.1.ffn_down.weight.*NaN or inf"):
    if weights == "gguf":
      model.configure_host_weights("gguf")
    else:
      model.generate([0, 5], max_new_tokens=2, temperature=0.0)


def test_a_file_replaced_after_load_is_refused(tmp_path):
  """Weights are read after load (lazily, or by the host path): a file replaced in between is
  a GGUFError, not a shape error from flax or the new weights under the old config."""
  import time
  import pijax
  import tiny_models
  from pijax.errors import GGUFError
  path = tiny_models.write_random_quantized_gguf(tmp_path / "m.gguf")
  model = pijax.load(path, max_seq_len=32)
  time.sleep(0.01)
  tiny_models.write_random_quantized_gguf(path, hidden=128, ffn=192)
  for run in (lambda: model.configure_host_weights("gguf"),
              lambda: model.generate([0, 5], max_new_tokens=2, temperature=0.0)):
    with pytest.raises(GGUFError, match="changed since it was loaded"):
      run()


def test_bench_ops_with_nothing_to_run_is_an_error():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", "pijax.bench_ops", "--nomatvec",
                         "--nosparse_ops", "--nodown_pass", "--nobandwidth"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and "nothing to run" in proc.stderr
  assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_synthetic_k_blocks_have_the_asked_statistics(qtype):
  rng = np.random.default_rng(1)
  blocks = synthetic.random_blocks(rng, 32, 512, qtype)
  w = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, qtype)).reshape(32, 512)
  assert abs(w.std() - 0.02) < 0.002 and abs(w.mean()) < 0.002
  assert len(np.unique(w)) > 10


def test_synthetic_q4_k_m_mix_runs_on_host_blocks(tmp_path):
  """The Q4_K_M mix (llama.cpp's per-tensor rule) at the 8-layer tiny-k shape: Q6_K head and
  attn_v / ffn_down on layers 0, 3, 6, 7, Q4_K elsewhere; the host path keeps every block (no
  re-quantization) and gives the XLA path's logits on the same values (XLA dequantizes with
  gguf.quants, the host reads the blocks with its own kernels)."""
  import pijax
  path = tmp_path / "k.gguf"
  synthetic.write(str(path), shape="tiny-k", qtype="Q4_K_M", activation="silu")
  types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
  assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
  assert [i for i in range(8) if types[f"blk.{i}.ffn_down.weight"] == "Q6_K"] == [0, 3, 6, 7]
  assert [i for i in range(8) if types[f"blk.{i}.attn_v.weight"] == "Q6_K"] == [0, 3, 6, 7]
  assert all(types[f"blk.{i}.ffn_gate.weight"] == "Q4_K" for i in range(8))
  model = pijax.load(path, max_seq_len=32)
  ids = [1, 5, 9, 300, 42, 7]
  ref = model.prompt_logits(ids)
  assert model.configure_host_weights("auto", dot="f32") == "gguf"
  dec = model.backend.decoder
  assert {dec.lm_head.kind, dec.layers[0].down.kind, dec.layers[1].down.kind} == {"q6_k", "q4_k"}
  assert dec.layers[0].qkv.kind == "mixed" and dec.layers[1].qkv.kind == "q4_k"
  got = model.prompt_logits(ids)
  np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_a_kv_cache_larger_than_ram_is_refused_before_allocation(tmp_path, monkeypatch):
  """max_seq_len=0 means the file's context_length; a context whose f32 KV cache exceeds the
  machine's RAM (a 128k-token model, or a lying value) is one ConfigError, nothing allocated."""
  import pijax
  from pijax import engine
  from pijax.errors import ConfigError
  path = synthetic.write(str(tmp_path / "t.gguf"), shape="tiny", qtype="Q8_0", activation="silu")
  real = engine.read_gguf

  def huge_context(*args, **kwargs):
    import dataclasses
    cfg, meta = real(*args, **kwargs)
    return dataclasses.replace(cfg, context_length=1 << 40), meta

  monkeypatch.setattr(engine, "read_gguf", huge_context)
  with pytest.raises(ConfigError, match="KV cache of 1099511627776 tokens needs .* --max_seq_len"):
    pijax.load(str(tmp_path / "t.gguf"), max_seq_len=0)
  assert pijax.load(str(tmp_path / "t.gguf"), max_seq_len=64).max_seq_len == 64
  del path


def test_a_symlink_repointed_after_load_is_refused(tmp_path):
  """Found by a tester: a symlink re-pointed after load to another file of the same size and
  mtime passed the (size, mtime) check, and the new weights ran under the old config. The
  stamp now holds the inode too."""
  import pijax
  import tiny_models
  from pijax.errors import GGUFError
  a = tiny_models.write_random_quantized_gguf(tmp_path / "a.gguf", seed=1)
  b = tiny_models.write_random_quantized_gguf(tmp_path / "b.gguf", seed=2)
  assert a.stat().st_size == b.stat().st_size
  st = a.stat()
  os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns))
  link = tmp_path / "model.gguf"
  link.symlink_to(a)
  model = pijax.load(str(link), max_seq_len=32)
  link.unlink()
  link.symlink_to(b)
  with pytest.raises(GGUFError, match="changed since it was loaded"):
    model.configure_host_weights("gguf")
