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
def test_generate_streams_text_and_stats(smollm2_path):
  # f32 products on both sides. With int8 activations the logits move by up to ~1 between code
  # numba compiled in this process and the same kernels loaded from its disk cache (fastmath
  # parallel kernels; BUILD_NOTES.md, issue 11), and this subprocess and pytest's process can
  # hold either; at f32 the two differ in the last bits only.
  proc = _run(CONFIG, "--prompt=The capital of France is", "--max_new_tokens=12", "--host_dot=f32")
  assert proc.returncode == 0, proc.stderr[-3000:]
  import pijax
  model = pijax.load(smollm2_path, max_seq_len=2048)
  assert model.configure_host_weights("auto", dot="f32") == "gguf"
  want = model.generate("The capital of France is", max_new_tokens=12).text
  assert proc.stdout == want + "\n"
  last = proc.stderr.strip().splitlines()[-1]
  for field in ("prompt tokens:", "new tokens:", "load:", "prefill:", "decode:"):
    assert field in last, last


@pytest.mark.slow
def test_generate_chat():
  # f32 decode products: the first reply token is a near-tie (logit margin 0.09) that int8
  # activations flip, as llama.cpp's do ("L'Étoile de France...": BUILD_NOTES, issue 11).
  proc = _run(CONFIG, "--prompt=What is the capital of France?", "--chat",
              "--max_new_tokens=48", "--host_dot=f32")
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
  assert "the bundle runs on the host engine over its source GGUF" in proc.stderr
  last = proc.stderr.strip().splitlines()[-1]
  sparsity = float(last.split("FFN sparsity:")[1].split("%")[0])
  assert 30.0 <= sparsity <= 70.0, last
  proc = _run(sparse_config, f"--model={opts.out}", "--prompt=The capital of France is",
              "--max_new_tokens=4", "--hot_ratio=0.3", "--sparse=oracle")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "every FFN neuron on the host" not in proc.stderr


# Every pijax CLI: flag errors give one line `<prog>: error: ...` and exit 2, before any model
# loads (the commands below name a model file that does not exist, so a check that ran after
# the load would report that file instead).
_CLIS = ("generate", "bench", "perplexity", "convert", "profile", "train_predictors", "place",
         "eval_predictors", "bench_compare")


def _run_cli(cli, *args, timeout=300):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", f"pijax.{cli}", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def _assert_cli_refused(proc, cli, *needles):
  _assert_one_line_error(proc, *needles)
  assert proc.stderr.startswith(f"pijax.{cli}: error: "), proc.stderr


@pytest.mark.parametrize("cli", _CLIS)
def test_missing_flagfile(cli, tmp_path):
  missing = str(tmp_path / "missing.flags")
  _assert_cli_refused(_run_cli(cli, f"--flagfile={missing}"), cli, "--flagfile", missing)


@pytest.mark.parametrize("flagfile", ["folder", "binary"])
def test_unreadable_flagfile(flagfile, tmp_path):
  path = tmp_path / "flags"
  if flagfile == "folder":
    path.mkdir()
  else:
    path.write_bytes(b"--prompt=\xff\xfe\n")
  _assert_cli_refused(_run(f"--flagfile={path}", "--prompt=hi"), "generate", "--flagfile")


# The CLIs that take --max_seq_len (the KV cache length), with their other required flags.
_MAX_SEQ_LEN_CLIS = {
    "generate": [CONFIG, "--prompt=hi", "--model={tmp}/missing.gguf"],
    "convert": ["--out={tmp}/bundle", "--calibration=README.md", "--device_budget_gb=0.5",
                "--model={tmp}/missing.gguf"],
    "train_predictors": ["--profile={tmp}", "--model={tmp}/missing.gguf"],
    "place": ["--profile={tmp}/profile.npz", "--out={tmp}/placement.json",
              "--device_budget_gb=0.5", "--model={tmp}/missing.gguf"],
}


@pytest.mark.parametrize("value", ["0", "-5"])
@pytest.mark.parametrize("cli", sorted(_MAX_SEQ_LEN_CLIS))
def test_max_seq_len_must_be_positive(cli, value, tmp_path):
  args = [a.format(tmp=tmp_path) for a in _MAX_SEQ_LEN_CLIS[cli]]
  _assert_cli_refused(_run_cli(cli, *args, f"--max_seq_len={value}"), cli,
                      f"--max_seq_len={value}")


def test_max_seq_len_zero_in_flagfile_or_config(tmp_path):
  flagfile = tmp_path / "flags"
  flagfile.write_text("--max_seq_len=0\n")
  _assert_cli_refused(_run(CONFIG, "--prompt=hi", f"--flagfile={flagfile}"), "generate",
                      "--max_seq_len=0")
  for cli, name, extra in [("generate", "smollm2_135m.py", ["--prompt=hi"]),
                           ("convert", "smollm2_135m_convert.py",
                            ["--calibration=README.md", f"--out={tmp_path}/bundle"])]:
    text = (ROOT / "configs" / name).read_text()
    assert "config.max_seq_len = 2048" in text
    cfg = tmp_path / name
    cfg.write_text(text.replace("config.max_seq_len = 2048", "config.max_seq_len = 0"))
    _assert_cli_refused(_run_cli(cli, f"--config={cfg}", *extra,
                                 f"--model={tmp_path}/missing.gguf"),
                        cli, "--config field max_seq_len=0")


@pytest.mark.parametrize("cli,args,needle", [
    ("generate", [CONFIG, "--prompt=hi", "--hot_ratio=2"], "--hot_ratio=2"),
    ("generate", [CONFIG, "--prompt=hi", "--prefill_dense_tokens=-1"],
     "--prefill_dense_tokens=-1"),
    ("generate", [CONFIG, "--prompt=hi", "hello"], "'hello'"),
    ("bench", ["-m", "{tmp}/missing.gguf", "--hot_ratio=-0.5"], "--hot_ratio=-0.5"),
    ("bench", ["-m", "{tmp}/missing.gguf", "stray"], "'stray'"),
    ("perplexity", ["-m", "{tmp}/missing.gguf", "-f", "README.md", "--kl_divergence"],
     "--kl_divergence_base"),
    ("perplexity", ["-m", "{tmp}/missing.gguf", "-f", "README.md", "-c", "3"], "-c 3"),
    ("perplexity", ["-m", "{tmp}/missing.gguf", "-f", "README.md",
                    "--kl_divergence_base={tmp}/no/such/folder/base.npy"], "--kl_divergence_base"),
    ("convert", ["--out={tmp}/b", "--calibration=README.md", "--model={tmp}/missing.gguf",
                 "--hot_ratio=2"], "--hot_ratio=2"),
    ("convert", ["--out={tmp}/b", "--calibration=README.md", "--model={tmp}/missing.gguf",
                 "--device_budget_gb=0.5", "--tile=0"], "--tile=0"),
    ("train_predictors", ["--profile={tmp}", "--model={tmp}/missing.gguf", "--epochs=0"],
     "--epochs=0"),
    ("eval_predictors", ["--model={tmp}/missing", "--text=README.md", "--threshold_scale=-1"],
     "--threshold_scale=-1"),
])
def test_bad_values_refused_before_load(cli, args, needle, tmp_path):
  args = [a.format(tmp=tmp_path) for a in args]
  _assert_cli_refused(_run_cli(cli, *args), cli, needle)


# ------------------------------------------------------------------ constrained output (issue 31)
PERSON_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "population": {"type": "integer", "minimum": 0, "maximum": 100000000}},
    "required": ["city", "population"], "additionalProperties": False}


@pytest.mark.parametrize("content, flag, needles", [
    ('{"type": "strin"}', "--json_schema", ["json_schema", "schema.txt", "strin"]),
    ("{not json", "--json_schema", ["--json_schema", "not JSON"]),
    ("start: nowhere", "--grammar", ["Lark grammar", "schema.txt"]),
    (None, "--json_schema", ["cannot read", "schema.txt"]),
])
def test_bad_schema_or_grammar_is_one_line(tmp_path, content, flag, needles):
  path = tmp_path / "schema.txt"
  if content is not None:
    path.write_text(content)
  _assert_one_line_error(_run(CONFIG, "--prompt=hi", f"{flag}={path}"), *needles)


@pytest.mark.parametrize("args, needle", [
    (["--response_format=yaml"], "--response_format"),
    (["--response_format=json_object", "--grammar=x.lark"], "give one of them"),
    (["--logit_bias=5"], "TOKEN_ID:BIAS"),
    (["--logit_bias=5:300"], "[-100, 100]"),
    (["--logit_bias=7:nan"], "[-100, 100]"),
    (["--logit_bias=-3:1"], "token id >= 0"),
])
def test_bad_constraint_flags_are_refused_before_load(args, needle, tmp_path):
  """Checked before the model loads: a missing model file is not what the error names."""
  _assert_one_line_error(_run(CONFIG, "--prompt=hi", f"--model={tmp_path / 'none.gguf'}", *args),
                         needle)


def test_logit_bias_past_the_vocabulary_is_one_line():
  _assert_one_line_error(_run(CONFIG, "--prompt=hi", "--logit_bias=99999999:1"),
                         "logit_bias", "99999999", "49152")


@pytest.mark.slow
def test_json_schema_from_the_cli(tmp_path):
  import json
  path = tmp_path / "city.json"
  path.write_text(json.dumps(PERSON_SCHEMA))
  proc = _run(CONFIG, "--prompt=The largest city of Japan, as JSON.", "--chat",
              f"--json_schema={path}", "--temperature=0.9", "--seed=3", "--max_new_tokens=80",
              "--host_dot=f32")
  assert proc.returncode == 0, proc.stderr
  value = json.loads(proc.stdout)
  assert set(value) == {"city", "population"} and isinstance(value["population"], int)
  assert "stop: eos" in proc.stderr
  proc = _run(CONFIG, "--prompt=Is Paris in France?", "--chat", f"--grammar={tmp_path / 'g'}")
  assert proc.returncode == 2  # A missing grammar file.
  (tmp_path / "g").write_text('start: "yes" | "no"')
  proc = _run(CONFIG, "--prompt=Is Paris in France?", "--chat", f"--grammar={tmp_path / 'g'}",
              "--logit_bias=2:-5", "--host_dot=f32")
  assert proc.returncode == 0 and proc.stdout.strip() in ("yes", "no"), proc.stderr
