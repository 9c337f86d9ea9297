"""`python -m pijax.generate` as a user runs it: stdout/stderr contract and exit status 2."""

import os
import pathlib
import subprocess
import sys

import gguf
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = "--config=" + str(ROOT / "configs" / "smollm2_135m.py")


def _run(*args, timeout=600):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "pijax.generate", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def _assert_one_line_error(proc, *needles):
  assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
  lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
  assert len(lines) == 1, proc.stderr
  assert "Traceback" not in proc.stderr
  for needle in needles:
    assert needle in lines[0], (needle, lines[0])
  assert proc.stdout.strip() == ""


def test_missing_model_file(tmp_path):
  missing = str(tmp_path / "missing.gguf")
  _assert_one_line_error(_run(CONFIG, f"--model={missing}", "--prompt=hi"), missing)


def test_text_file_named_gguf(tmp_path):
  path = tmp_path / "readme.gguf"
  path.write_text("hello, I am not a model\n" * 10)
  _assert_one_line_error(_run(CONFIG, f"--model={path}", "--prompt=hi"), str(path),
                         "not a GGUF")


def test_truncated_model(tmp_path, smollm2_path):
  data = pathlib.Path(smollm2_path).read_bytes()
  path = tmp_path / "cut.gguf"
  path.write_bytes(data[: len(data) // 2])
  _assert_one_line_error(_run(CONFIG, f"--model={path}", "--prompt=hi"), str(path))


def test_unsupported_architecture(tmp_path):
  path = tmp_path / "falcon.gguf"
  w = gguf.GGUFWriter(str(path), "falcon")
  w.add_tensor("x", np.ones((2, 2), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  _assert_one_line_error(_run(CONFIG, f"--model={path}", "--prompt=hi"), str(path), "falcon")


def test_unsupported_tensor_type(tmp_path):
  import tiny_models
  hf = tiny_models.make_hf_llama(seed=4, layers=1)
  good = tiny_models.write_gguf(hf, tmp_path / "good.gguf")
  data = bytearray(good.read_bytes())
  # Re-label the first tensor's type (F32 = 0) as an unknown ggml type id in its tensor info.
  reader = gguf.GGUFReader(str(good))
  field_offset = reader.tensors[0].field.offset if hasattr(reader.tensors[0], "field") else None
  del reader
  name = b"token_embd.weight"
  at = data.index(name) + len(name)
  n_dims = int.from_bytes(data[at:at + 4], "little")
  type_at = at + 4 + 8 * n_dims
  assert int.from_bytes(data[type_at:type_at + 4], "little") == 0
  data[type_at:type_at + 4] = (250).to_bytes(4, "little")
  path = tmp_path / "weird_type.gguf"
  path.write_bytes(bytes(data))
  del field_offset
  _assert_one_line_error(_run(CONFIG, f"--model={path}", "--prompt=hi"), str(path))


@pytest.mark.parametrize("flag,needle", [
    ("--temperature=-1", "temperature"),
    ("--repeat_penalty=0", "repeat_penalty"),
    ("--top_p=1.5", "top_p"),
    ("--max_new_tokens=-3", "max_new_tokens"),
])
def test_bad_sampling_flags(flag, needle):
  _assert_one_line_error(_run(CONFIG, "--prompt=hi", flag), needle)


def test_missing_config_file():
  proc = _run("--config=configs/nope.py", "--prompt=hi")
  _assert_one_line_error(proc, "config")


def test_unknown_flag():
  _assert_one_line_error(_run(CONFIG, "--prompt=hi", "--tempreature=1"), "tempreature")


@pytest.mark.slow
def test_prompt_longer_than_context():
  prompt = " ".join(["word"] * 100)  # 100 tokens.
  _assert_one_line_error(_run(CONFIG, f"--prompt={prompt}", "--max_seq_len=64"), "64", "100")


@pytest.mark.slow
def test_generate_streams_text_and_stats(smollm2):
  proc = _run(CONFIG, "--prompt=The capital of France is", "--max_new_tokens=12")
  assert proc.returncode == 0, proc.stderr[-3000:]
  want = smollm2.generate("The capital of France is", max_new_tokens=12).text
  assert proc.stdout == want + "\n"
  last = proc.stderr.strip().splitlines()[-1]
  for field in ("prompt tokens:", "new tokens:", "load:", "prefill:", "decode:"):
    assert field in last, last


@pytest.mark.slow
def test_generate_chat():
  proc = _run(CONFIG, "--prompt=What is the capital of France?", "--chat",
              "--max_new_tokens=48")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "Paris" in proc.stdout
  assert "stop: eos" in proc.stderr


def test_huge_seed_is_refused():
  _assert_one_line_error(_run(CONFIG, "--prompt=hi", "--seed=99999999999999999999"), "seed")


def test_config_missing_fields(tmp_path):
  cfg = tmp_path / "cfg.py"
  cfg.write_text("import ml_collections\n\ndef get_config():\n"
                 "  c = ml_collections.ConfigDict()\n  c.model = 'default'\n  return c\n")
  _assert_one_line_error(_run(f"--config={cfg}", "--prompt=hi"), "dtype")


def test_overflowing_float_values_are_refused():
  _assert_one_line_error(_run(CONFIG, "--prompt=hi", "--temperature=1e300"), "temperature")


@pytest.mark.slow
def test_closed_stdout_exits_quietly():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      f"{sys.executable} -m pijax.generate {CONFIG} --prompt='Once upon a time' "
      "--max_new_tokens=40 | head -c 5", shell=True, cwd=ROOT, env=env, capture_output=True,
      text=True, timeout=600)
  assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert len(proc.stdout) == 5


@pytest.mark.slow
def test_invalid_utf8_prompt(smollm2):
  from pijax.errors import ContextError
  with pytest.raises(ContextError, match="UTF-8"):
    smollm2.generate("a\udcffb", max_new_tokens=2)
  from pijax.errors import ConfigError
  with pytest.raises(ConfigError):
    smollm2.generate(b"hello", max_new_tokens=2)
  with pytest.raises(ConfigError):
    smollm2.generate([1.7, 504.0], max_new_tokens=2)
  with pytest.raises(ConfigError):
    smollm2.generate("hi", max_new_tokens=2.5)


@pytest.mark.slow
def test_generate_sparse_predictor_cli(converted):
  """The issue-4 command: generate from a bundle with the FFN split; on a CPU backend every
  neuron goes to the host unless placement flags say otherwise; the text names the capital."""
  opts, _ = converted
  sparse_config = "--config=" + str(ROOT / "configs" / "smollm2_135m_sparse.py")
  proc = _run(sparse_config, f"--model={opts.out}", "--prompt=The capital of France is",
              "--max_new_tokens=12")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "Paris" in proc.stdout
  assert "every FFN neuron on the host (--hot_ratio=0)" in proc.stderr
  last = proc.stderr.strip().splitlines()[-1]
  sparsity = float(last.split("FFN sparsity:")[1].split("%")[0])
  assert 30.0 <= sparsity <= 70.0, last
  proc = _run(sparse_config, f"--model={opts.out}", "--prompt=The capital of France is",
              "--max_new_tokens=4", "--hot_ratio=0.3", "--sparse=oracle")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "every FFN neuron on the host" not in proc.stderr
