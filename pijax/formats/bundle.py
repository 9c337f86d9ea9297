"""Converted bundles: neuron order, predictors and thresholds in an orbax checkpoint.

A bundle is a folder:
  manifest.json  what was converted and measured (format, version, model config, source GGUF
                 path + sha256, calibration text + token count, per-layer threshold, hot count,
                 predictor rank, recall, precision, predicted and true sparsity, device bytes).
  checkpoint/    orbax checkpoint of
                   predictors/layers_i/{fc1: f32[D, r_i], fc2: f32[r_i, F]} (permuted order;
                     MLP-predictor bundles only, manifest predictor.kind "mlp"),
                   lowbit/layers_i/{gate_codes, up_codes: u8[F, D/2], gate_scales,
                     up_scales: f16[F, D/32]} (low-bit-predictor bundles, kind "lowbit": the
                     4-bit sketch of the permuted gate/up rows, `pijax.offline.predictor`),
                   perm: i32[L, F] original index of each stored neuron,
                   thresholds: f32[L] contribution thresholds t_l, cuts: f32[L] predictor logit
                   cuts, rms_bounds: f32[L] residual rms above which a token runs dense,
                   frequencies: f32[L, F] activation probability per token (permuted).
Every weight comes from the source GGUF, whose sha256 must match the manifest: at load the
FFN rows are the source's own values in the bundle's neuron order (`permute_ffn`: neurons sorted
by descending activation frequency, "row-column bundling": the down projection transposed so
one neuron's weights are three contiguous rows; LLM in a Flash, arXiv 2312.11514 §3.2). Version
1 bundles also stored those rows as f32 (ffn/layers_i/{gate, up, down}: f32[F, D]; 6x the
SmolLM2 GGUF's bytes); they still load. Bundles are written to a temporary sibling folder and
renamed into place.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from typing import Any

import jax.numpy as jnp
import numpy as np

from pijax.errors import BundleError

BUNDLE_FORMAT = "pijax-bundle"
BUNDLE_VERSION = 2
# Versions this pijax reads: 1 stored the permuted FFN rows as f32, 2 derives them from the source.
READ_VERSIONS = (1, 2)
MANIFEST_FILE = "manifest.json"
CHECKPOINT_DIR = "checkpoint"


def is_bundle(path: str | os.PathLike[str]) -> bool:
  return os.path.isdir(path) and os.path.exists(os.path.join(path, MANIFEST_FILE))


def permutation_from_counts(counts: np.ndarray) -> np.ndarray:
  """i32[L, F]: per layer, neuron indices by descending activation count (stable on ties)."""
  return np.argsort(-np.asarray(counts), axis=1, kind="stable").astype(np.int32)


def permute_ffn(params: Any, n_layers: int, perm: np.ndarray) -> dict[str, Any]:
  """Neuron-major permuted FFN weights {layers_i: {gate, up, down}: f32[F, D]} from dense params.

  Dense kernels are gate/up [D, F] and down [F, D]; neuron j of the result is neuron perm[l, j].
  """
  out = {}
  for i in range(n_layers):
    ffn = params[f"layers_{i}"]["ffn"]
    p = perm[i]
    out[f"layers_{i}"] = {
        "gate": np.ascontiguousarray(np.asarray(ffn["gate"]["kernel"]).T[p]),
        "up": np.ascontiguousarray(np.asarray(ffn["up"]["kernel"]).T[p]),
        "down": np.ascontiguousarray(np.asarray(ffn["down"]["kernel"])[p]),
    }
  return out


def with_ffn(params: Any, ffn: dict[str, Any], dtype: Any) -> dict[str, Any]:
  """Dense params whose FFN kernels are the (permuted, neuron-major) bundle weights."""
  out = dict(params)
  for name, rows in ffn.items():
    layer = dict(out[name])
    layer["ffn"] = {"gate": {"kernel": jnp.asarray(np.asarray(rows["gate"]).T, dtype)},
                    "up": {"kernel": jnp.asarray(np.asarray(rows["up"]).T, dtype)},
                    "down": {"kernel": jnp.asarray(rows["down"], dtype)}}
    out[name] = layer
  return out


def write_bundle(out_dir: str, tree: dict[str, Any], manifest: dict[str, Any], *,
                 overwrite: bool = False) -> None:
  """Writes checkpoint + manifest atomically: a temporary sibling folder renamed to out_dir.

  Raises:
    BundleError: out_dir exists and overwrite is False, or it exists and is not a bundle.
  """
  import orbax.checkpoint as ocp
  out_dir = os.path.abspath(out_dir)
  if os.path.exists(out_dir) and not overwrite:
    raise BundleError(f"{out_dir} already exists; choose another --out or pass --overwrite.")
  if os.path.exists(out_dir) and not is_bundle(out_dir):
    raise BundleError(f"{out_dir} exists and is not a bundle; --overwrite only replaces a "
                      "bundle: choose another --out.")
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".tmp-", dir=parent)
  try:
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(tmp, CHECKPOINT_DIR), tree)
    checkpointer.wait_until_finished()
    with open(os.path.join(tmp, MANIFEST_FILE), "w") as f:
      json.dump(manifest, f, indent=1)
    if os.path.exists(out_dir):
      old = tmp + ".old"
      os.replace(out_dir, old)
      os.replace(tmp, out_dir)
      shutil.rmtree(old, ignore_errors=True)
    else:
      os.replace(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def read_manifest(path: str) -> dict[str, Any]:
  """The manifest of a bundle, version-checked. Raises BundleError."""
  manifest_path = os.path.join(path, MANIFEST_FILE)
  try:
    with open(manifest_path) as f:
      manifest = json.load(f)
  except (OSError, ValueError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors.
    raise BundleError(f"{manifest_path}: unreadable bundle manifest "
                      f"({' '.join(str(err).split())[:200]}); re-run pijax.convert.") from None
  if not isinstance(manifest, dict):
    raise BundleError(f"{manifest_path}: not a bundle manifest (a JSON object); re-run "
                      "pijax.convert.")
  version = manifest.get("version")
  if manifest.get("format") != BUNDLE_FORMAT or type(version) is not int or \
      version not in READ_VERSIONS:
    raise BundleError(f"{path}: bundle format {manifest.get('format')!r} version "
                      f"{manifest.get('version')!r}, but this pijax reads {BUNDLE_FORMAT!r} "
                      f"versions {', '.join(map(str, READ_VERSIONS))}; re-run pijax.convert.")
  return manifest


def read_checkpoint(path: str) -> dict[str, Any]:
  """The bundle's orbax checkpoint as a tree of numpy arrays. Raises BundleError."""
  import orbax.checkpoint as ocp
  ckpt = os.path.join(os.path.abspath(path), CHECKPOINT_DIR)
  if not os.path.isdir(ckpt):
    raise BundleError(f"{path}: the bundle has no {CHECKPOINT_DIR}/ folder; re-run "
                      "pijax.convert.")
  try:
    tree = ocp.StandardCheckpointer().restore(ckpt)
  except Exception as err:
    raise BundleError(f"{ckpt}: cannot restore the checkpoint ({type(err).__name__}: "
                      f"{' '.join(str(err).split())[:300]}); re-run pijax.convert.") from None
  return jax_tree_to_numpy(tree)


def jax_tree_to_numpy(tree: Any) -> Any:
  import jax
  return jax.tree_util.tree_map(np.asarray, tree)


@dataclasses.dataclass
class SparseBundle:
  """The sparse side of a loaded bundle (neurons in permuted order, layer l = layers_l).

  Attributes:
    path: bundle folder.
    manifest: its manifest.json.
    ffn: {layers_i: {gate, up, down}: f32[F, D]} neuron-major weights (numpy, host): read
      from a version 1 checkpoint, else None until `pijax.load` builds them from the source
      GGUF's (`permute_ffn`).
    predictors: {layers_i: {fc1: f32[D, r], fc2: f32[r, F]}} ({} in a low-bit bundle).
    predictor_kind: the predictor convert built ("mlp" | "lowbit"; "mlp" before it was recorded).
    lowbit: {layers_i: low-bit predictor arrays} (`pijax.offline.predictor.lowbit_params`), or
      None (an MLP bundle: the runtime quantizes the rows if asked for the low-bit predictor).
    cuts: f32[L] predictor logit cuts; thresholds: f32[L] contribution thresholds.
    rms_bounds: f32[L] residual rms above which a token runs dense (inf: never).
    frequencies: f32[L, F]; perm: i32[L, F]; hot_counts: list of L ints (placement).
  """

  path: str
  manifest: dict[str, Any]
  ffn: dict[str, Any] | None
  predictors: dict[str, Any]
  cuts: np.ndarray
  thresholds: np.ndarray
  rms_bounds: np.ndarray
  frequencies: np.ndarray
  perm: np.ndarray
  hot_counts: list[int]
  predictor_kind: str = "mlp"
  lowbit: dict[str, Any] | None = None


def open_bundle(path: str, *, source: str | None = None
                ) -> tuple[SparseBundle, str, str | None]:
  """Reads a bundle and checks its source GGUF: (bundle, source GGUF path, ffn_activation).

  Args:
    path: bundle folder (holding manifest.json).
    source: the source GGUF, if it moved since conversion (default: the manifest's path).

  Raises:
    BundleError: wrong version, missing source, or a source whose sha256 does not match.
  """
  from pijax.profile import file_sha256
  manifest = read_manifest(path)
  try:
    src = source or manifest["source"]["path"]
    want = manifest["source"]["sha256"]
    layers = manifest["layers"]
    hidden, inter = (manifest["model"][k] for k in ("hidden_size", "intermediate_size"))
    if not isinstance(src, str) or not isinstance(want, str) or not isinstance(layers, list) \
        or any(type(v) is not int or v <= 0 for v in (hidden, inter)):
      raise TypeError
    hot_counts = [layer["hot_count"] for layer in layers]
    if any(type(h) is not int or not 0 <= h <= inter for h in hot_counts):
      raise TypeError
  except (KeyError, TypeError, IndexError):
    raise BundleError(f"{path}: its manifest lacks or mistypes source.path / source.sha256 / "
                      "layers[].hot_count / model sizes; re-run pijax.convert.") from None
  n_layers = len(layers)
  if not os.path.isfile(src):
    raise BundleError(f"{path}: its source GGUF {src} is not a file; put the original GGUF "
                      "back at that path (or re-convert).")
  digest = file_sha256(src)
  if digest != want:
    raise BundleError(f"{path}: converted from a GGUF with sha256 "
                      f"{want[:16]}..., but {src} has sha256 "
                      f"{digest[:16]}...; put the original file back at that path or re-convert.")
  tree = read_checkpoint(path)
  _check_perm(path, tree.get("perm"), n_layers, inter)
  if manifest["version"] >= 2:
    recorded = manifest.get("perm_sha256")
    if recorded != perm_sha256(tree["perm"]):
      raise BundleError(f"{path}: its neuron order (perm) " + (
          "does not match the sha256 its manifest recorded at conversion" if recorded else
          "has no sha256 in its manifest (perm_sha256)") + "; re-run pijax.convert.")
    if "ffn" in tree:  # Never trusted over the source: version 2 gathers the source's rows.
      raise BundleError(f"{path}: a version {manifest['version']} bundle holding ffn rows; "
                        "re-run pijax.convert.")
  elif "ffn" not in tree:
    raise BundleError(f"{path}: a version 1 bundle without its ffn rows; re-run pijax.convert.")
  else:
    _check_ffn(path, tree["ffn"], n_layers, inter, hidden)
  per_layer = {"cuts": (n_layers,), "thresholds": (n_layers,), "rms_bounds": (n_layers,),
               "frequencies": (n_layers, inter)}
  for key, shape in per_layer.items():
    value = tree.get(key)
    if key == "rms_bounds" and value is None:
      continue
    arr = np.asarray(value) if value is not None else None
    if arr is None or arr.shape != shape or arr.dtype.kind != "f" or \
        (key != "cuts" and np.isnan(arr).any()):
      got = "missing" if arr is None else f"{arr.dtype.name}{list(arr.shape)}"
      raise BundleError(f"{path}: its checkpoint's {key} is {got}, expected float{list(shape)} "
                        "without NaN; re-run pijax.convert.")
  bundle = SparseBundle(
      path=os.path.abspath(path), manifest=manifest, ffn=tree.get("ffn"),
      predictors=tree.get("predictors", {}), cuts=tree["cuts"], thresholds=tree["thresholds"],
      rms_bounds=tree.get("rms_bounds", np.full(n_layers, np.inf, np.float32)),
      frequencies=tree["frequencies"], perm=tree["perm"], hot_counts=hot_counts,
      predictor_kind=_predictor_kind(path, manifest), lowbit=tree.get("lowbit"))
  if (bundle.predictor_kind == "mlp") != bool(bundle.predictors) or \
      (bundle.predictor_kind == "lowbit") != (bundle.lowbit is not None):
    raise BundleError(f"{path}: its manifest's predictor kind {bundle.predictor_kind!r} does "
                      "not match the predictors its checkpoint holds; re-run pijax.convert.")
  if bundle.lowbit is not None:
    _check_lowbit(path, bundle.lowbit, n_layers, inter, hidden)
  return bundle, src, manifest["model"].get("ffn_activation")


def perm_sha256(perm: Any) -> str:
  """sha256 of a neuron order as i32 bytes (C order): what a version 2 manifest records, since
  the order decides which of the source's rows each stored neuron is."""
  import hashlib
  return hashlib.sha256(np.ascontiguousarray(perm, np.int32).tobytes()).hexdigest()


def check_source_config(bundle: SparseBundle, config: Any) -> None:
  """BundleError unless the bundle's layer and FFN sizes are the source model's (a manifest
  edited, or converted from another file with the same sha256 claim)."""
  model = bundle.manifest["model"]
  want = (len(bundle.hot_counts), model["hidden_size"], model["intermediate_size"])
  have = (config.n_layers, config.hidden_size, config.intermediate_size)
  if want != have:
    raise BundleError(f"{bundle.path}: the bundle describes {want[0]} layers of hidden_size "
                      f"{want[1]}, intermediate_size {want[2]}, but its source has {have[0]}, "
                      f"{have[1]}, {have[2]}; re-run pijax.convert.")


def _check_ffn(path: str, ffn: Any, n_layers: int, n: int, d: int) -> None:
  """BundleError unless a version 1 checkpoint's ffn holds every layer's gate, up and down as
  float [F, D] rows."""
  for i in range(n_layers):
    rows = ffn.get(f"layers_{i}") if isinstance(ffn, dict) else None
    for w in ("gate", "up", "down"):
      arr = rows.get(w) if isinstance(rows, dict) else None
      if arr is None or np.shape(arr) != (n, d) or np.asarray(arr).dtype.kind != "f":
        got = "missing" if arr is None else \
            f"{np.asarray(arr).dtype.name}{list(np.shape(arr))}"
        raise BundleError(f"{path}: its ffn rows layers_{i}/{w} are {got}, expected "
                          f"float[{n}, {d}]; re-run pijax.convert.")


def _check_perm(path: str, perm: Any, n_layers: int, n_neurons: int) -> None:
  """BundleError unless perm is an integer [L, F] array whose rows are permutations of range(F)
  (the FFN rows are gathered by it: a bad index would silently mix up neurons)."""
  arr = np.asarray(perm) if perm is not None else None
  if arr is None or arr.shape != (n_layers, n_neurons) or arr.dtype.kind not in "iu" or \
      not np.array_equal(np.sort(arr, axis=1), np.broadcast_to(np.arange(n_neurons), arr.shape)):
    got = "missing" if arr is None else f"{arr.dtype.name}{list(arr.shape)}"
    raise BundleError(f"{path}: its neuron order (perm) is {got}, not {n_layers} permutations "
                      f"of {n_neurons} neurons; re-run pijax.convert.")


def _predictor_kind(path: str, manifest: dict[str, Any]) -> str:
  """The manifest's predictor kind ("mlp" when the bundle predates the record)."""
  record = manifest.get("predictor")
  if record is None:
    return "mlp"
  kind = record.get("kind", "mlp") if isinstance(record, dict) else None
  if kind not in ("mlp", "lowbit"):
    raise BundleError(f"{path}: its manifest's \"predictor\" must be {{\"kind\": \"mlp\" or "
                      f"\"lowbit\"}}, got {record!r}; re-run pijax.convert.")
  return kind


def _check_lowbit(path: str, lowbit: Any, n_layers: int, n: int, d: int) -> None:
  """BundleError unless every layer has the low-bit predictor's four arrays with the shapes
  and dtypes of its FFN rows, n neurons of d values (`pijax.offline.predictor.lowbit_params`)."""
  for i in range(n_layers):
    name = f"layers_{i}"
    layer = lowbit.get(name) if isinstance(lowbit, dict) else None
    if not isinstance(layer, dict):
      raise BundleError(f"{path}: its checkpoint lacks the low-bit predictor of {name}; "
                        "re-run pijax.convert.")
    want = {"gate_codes": ((n, d // 2), np.uint8), "up_codes": ((n, d // 2), np.uint8),
            "gate_scales": ((n, d // 32), np.float16), "up_scales": ((n, d // 32), np.float16)}
    for key, (shape, dtype) in want.items():
      value = layer.get(key)
      if value is None or np.shape(value) != shape or np.asarray(value).dtype != dtype:
        got = "missing" if value is None else \
            f"{np.asarray(value).dtype.name}{list(np.shape(value))}"
        raise BundleError(f"{path}: low-bit predictor array {name}/{key} is {got}, expected "
                          f"{np.dtype(dtype).name}{list(shape)}; re-run pijax.convert.")
