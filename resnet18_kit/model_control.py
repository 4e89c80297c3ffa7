"""Swap a model's config on a running tritonserver: Triton's model-control API (the KServe v2 repository
extension: gRPC RepositoryModelLoad, over HTTP `POST /v2/repository/models/<model>/load`, with the new
config as a JSON override; ModelControl says why gRPC), behind the admin key.

What Triton does with such a load (docs/model-repository.md "Swapping configs"; tests/test_swap_live.py): it
starts the new config's instances (new stub processes) beside the old ones, swaps them in once loaded and
warmed up, reloads the ensembles that use the model, and unloads the old instances when their requests are
done; requests keep being answered throughout. A config identical to the one serving is a no-op. A config
Triton refuses (its model fails to load) leaves the old one serving. But a config the model accepts and an
ensemble cannot use (another tensor name, dtype or shape, a smaller max_batch_size) loads, and Triton then
*unloads the ensemble*: so `check_fit` refuses it here, before anything is sent.

`swap` loads each target in turn, checks it serves (the model and every ensemble ready, the server's
config carries the new one's settings) and, when one fails, puts back the configs it already changed, so a
failed swap leaves every model on its previous config.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from resnet18_kit.contract import DEFAULT_VARIANT
from resnet18_kit.observe.model_config import ModelConfigView, parse_served_config, read_config
from resnet18_kit.repository import ModelRepository
from resnet18_kit.server.config import ADMIN_GRPC_HEADER

#: tritonserver --model-control-mode values `serve` accepts: "none" (the models of the repository load at
#: start and nothing can load or unload them) and "explicit" (they load at start, `--load-model=*`, and the
#: model-control API, locked behind the admin key, swaps them).
MODEL_CONTROL_MODES = ("none", "explicit")
#: Seconds a swap may take per model (its load, warm-up included, and the ensembles' reload).
DEFAULT_SWAP_TIMEOUT_S = 300.0


class SwapError(Exception):
    """A swap refused or failed; the message is one line naming why. exit_status: 2 for what is wrong
    before anything is sent (unknown variant, unreadable file, a config an ensemble cannot use), 1 when
    the server refused or did not finish it (the previous configs serve again)."""

    def __init__(self, message: str, exit_status: int = 2):
        super().__init__(message)
        self.exit_status = exit_status


@dataclass(frozen=True)
class SwapTarget:
    """One model and the config to load for it (a tritonclient.grpc.model_config_pb2.ModelConfig);
    source: where it was read (shown in messages)."""

    model: str
    config: object
    source: str


@dataclass(frozen=True)
class SwapOutcome:
    """What one model serves after a swap: `serving` is describe() of the config the server reports;
    seconds: from the load request to the new config serving; changed: False when the server already
    ran this config (Triton does nothing)."""

    model: str
    serving: str
    seconds: float
    changed: bool


def variant_targets(repository: ModelRepository, variant: str, models: list[str] | None = None) -> list[SwapTarget]:
    """The configs a variant (`--model-config-name`) gives `models` (default: every model of the
    repository): <model>/configs/<variant>.pbtxt where it exists, else config.pbtxt, as tritonserver
    picks them at start ("default": config.pbtxt everywhere). SwapError for a variant no model has."""
    if variant != DEFAULT_VARIANT and variant not in repository.variant_names():
        raise SwapError(f"--model-config-name {variant}: no model in {repository.root} has configs/{variant}.pbtxt; "
                        f"known names: {', '.join(repository.variant_names())}")
    targets = []
    for model in models or repository.model_names():
        path = repository.config_path(model, variant)
        if not path.is_file():
            raise SwapError(f"{model}: no such model in {repository.root}")
        targets.append(SwapTarget(model, _read(path, model), str(path)))
    return targets


def file_target(path: Path, model: str | None = None) -> SwapTarget:
    """The config in file `path` (config.pbtxt syntax) for `model` (default: its `name`). SwapError when
    the file cannot be read or parsed, names no model, or names another model than `model`."""
    config = _read(path, model)
    if not config.name:
        raise SwapError(f"{path}: the config has no `name`; give the model with --model")
    if model and config.name != model:
        raise SwapError(f"{path}: the config is for model {config.name!r}, not {model!r}")
    return SwapTarget(config.name, config, str(path))


def _read(path: Path, model: str | None):
    from google.protobuf import text_format

    try:
        config = read_config(path)
    except OSError as exc:
        raise SwapError(f"{path}: {exc.strerror or exc}") from None
    except text_format.ParseError as exc:
        raise SwapError(f"{path}: not a model config: {exc}") from None
    if not config.name and model:
        config.name = model
    return config


def check_fit(target: SwapTarget, served: dict) -> None:
    """SwapError when a served ensemble could not use `target` in place of the config it was loaded with
    (Triton would load the model and unload the ensemble): a tensor the ensemble maps missing, or with
    another dtype or shape than the serving config's, or a max_batch_size below the ensemble's.
    served: model name -> the ModelConfig each served model runs (served_configs)."""
    new, old = target.config, served.get(target.model)
    for ensemble in served.values():
        for step in ensemble.ensemble_scheduling.step:
            if step.model_name != target.model:
                continue
            where = f"ensemble {ensemble.name!r} uses {target.model}"
            for kind, names in (("input", step.input_map.keys()), ("output", step.output_map.keys())):
                new_tensors = {t.name: t for t in getattr(new, kind)}
                old_tensors = {t.name: t for t in getattr(old, kind)} if old is not None else {}
                for name in names:
                    if name not in new_tensors:
                        raise SwapError(f"{target.source}: {where}'s {kind} {name!r}, which this config lacks")
                    was = old_tensors.get(name)
                    if was is not None and (was.data_type, list(was.dims)) != (new_tensors[name].data_type,
                                                                                list(new_tensors[name].dims)):
                        raise SwapError(f"{target.source}: {where}'s {kind} {name!r} as {_tensor(was)}; this "
                                        f"config makes it {_tensor(new_tensors[name])}")
            if new.max_batch_size < ensemble.max_batch_size:
                raise SwapError(f"{target.source}: max_batch_size {new.max_batch_size}, but {where} with batches "
                                f"of up to {ensemble.max_batch_size}")


def _tensor(tensor) -> str:
    from tritonclient.grpc import model_config_pb2

    return f"{model_config_pb2.DataType.Name(tensor.data_type)} {list(tensor.dims)}"


def describe(config) -> str:
    """One line for a config: backend and the kit's runtime parameters, instances, batching and queue,
    e.g. "python (runtime openvino, model.int8.onnx), 2 instances, max_batch_size 16, preferred [8, 16],
    queue 64"."""
    view = ModelConfigView.of(config)
    if config.platform == "ensemble":
        return f"ensemble of {', '.join(step.model_name for step in config.ensemble_scheduling.step)}, " \
               f"max_batch_size {view.max_batch_size}"
    parameters = [view.parameters[key] for key in ("runtime", "model_filename") if key in view.parameters]
    text = view.backend + (f" ({', '.join(parameters)})" if parameters else "")
    try:
        text += f", {view.instance_count()} instances"
    except ValueError:  # a GPU group on a machine without one: the server would not have loaded it
        pass
    text += f", max_batch_size {view.max_batch_size}"
    if view.dynamic_batching:
        text += f", preferred {list(view.preferred_batch_sizes)}, queue {view.max_queue_size or 'unbounded'}"
    return text


class ModelControl:
    """The model-control API of the server whose gRPC endpoint is `url` (host:port), with `admin_key`;
    timeout_s: seconds one load may take. Errors are SwapError with one line. A context manager (closes).

    gRPC, not HTTP: Triton's HTTP server answers a load on one of its worker threads and holds every other
    request of that thread's connections until the load is done (upstream defect `http-load-holds`, in no
    fixed release: resnet18_kit.upstream.defects; tests/test_swap_live.py reproduces it), while its gRPC
    server loads on a thread of its own."""

    def __init__(self, url: str, admin_key: str | None, timeout_s: float = DEFAULT_SWAP_TIMEOUT_S):
        import tritonclient.grpc as grpcclient

        self.url = url
        self.timeout_s = timeout_s
        self.headers = {ADMIN_GRPC_HEADER: admin_key} if admin_key else None
        self.client = grpcclient.InferenceServerClient(url)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> "ModelControl":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def served_configs(self) -> dict:
        """Model name -> ModelConfig of every model the server has READY (repository index, restricted)."""
        index = self._call("read the model repository index", self.client.get_model_repository_index,
                           headers=self.headers, as_json=True, client_timeout=10.0)
        ready = [entry["name"] for entry in index.get("models", []) if entry.get("state") == "READY"]
        return {name: self.served_config(name) for name in ready}

    def served_config(self, model: str):
        """The ModelConfig the server runs for `model` (open API)."""
        answer = self._call(f"read {model}'s config", self.client.get_model_config, model, as_json=True,
                            client_timeout=10.0)
        return parse_served_config(answer["config"])

    def load(self, model: str, config) -> None:
        """Load `config` for `model` (protobuf ModelConfig) and return once the server answers (Triton
        answers after the load and the warm-up)."""
        from google.protobuf import json_format

        self._call(f"load {model}", self.client.load_model, model, headers=self.headers,
                   config=json_format.MessageToJson(config), client_timeout=self.timeout_s)

    def ready(self, model: str) -> bool:
        """True when `model` is ready on the server."""
        return bool(self._call(f"ask whether {model} is ready", self.client.is_model_ready, model,
                               client_timeout=10.0))

    def _call(self, what: str, method, *args, **kwargs):
        from tritonclient.utils import InferenceServerException

        try:
            return method(*args, **kwargs)
        except InferenceServerException as exc:
            raise SwapError(refusal(what, self.url, exc.status(), exc.message() or str(exc)), 1) from None


def refusal(what: str, url: str, status: str | None, message: str) -> str:
    """One line for a refused model-control call: a missing or wrong admin key (403; also what a kit
    server started with model control "none" answers, its model-control API being locked by a key of its
    own: server.tritonserver.server_command), a server without model control, or Triton's own first line."""
    first = message.strip().splitlines()[0] if message.strip() else "no reason given"
    if "restricted" in message or str(status) in ("403", "StatusCode.PERMISSION_DENIED"):
        return (f"{url} refused to {what}: the admin key is missing or wrong (set $TRITON_ADMIN_KEY to the key "
                f"the server was started with), or the server runs without model control (start it with "
                f"`--model-control explicit`)")
    if "failed to connect" in message or "Connection refused" in message:
        return f"no server answers gRPC at {url}: {first}"
    if "explicit model load / unload is not allowed" in message or "not allowed" in first and "load" in first:
        return (f"{url} does not allow model control: start it with `--model-control explicit` (serve, fleet) "
                f"or TRITON_MODEL_CONTROL=explicit (compose)")
    return f"{url} refused to {what}: {first}"


def swap(control: ModelControl, targets: list[SwapTarget], timeout_s: float = DEFAULT_SWAP_TIMEOUT_S,
         on_line: Callable[[str], None] = lambda line: None, served: dict | None = None) -> list[SwapOutcome]:
    """Load every target's config on the server of `control` (module doc) and return what each model
    serves then. Every target is checked against the serving ensembles first (check_fit); then each is
    loaded, its ensembles waited for (up to `timeout_s`), and its config as the server reports it read
    back. On a failure the models already swapped get their previous config back and SwapError is raised
    (exit_status 1), naming the model and the server's reason. served: the configs the server runs (model
    -> ModelConfig, ModelControl.served_configs) when the caller has just read them; read here otherwise."""
    served = control.served_configs() if served is None else served
    for target in targets:
        if target.model not in served:
            raise SwapError(f"{target.model}: the server at {control.url} serves no such model "
                            f"(it serves {', '.join(sorted(served)) or 'none'})")
        check_fit(target, served)
    ensembles = [name for name, config in served.items() if config.platform == "ensemble"]
    outcomes, done = [], []
    for target in sorted(targets, key=lambda t: t.model in ensembles):  # steps before the ensembles
        previous = served[target.model]
        started = time.monotonic()
        try:
            control.load(target.model, target.config)
            _wait_ready(control, [target.model, *ensembles], started + timeout_s)
        except SwapError as exc:
            changed = [] if _unchanged(control, target.model, previous) else [(target.model, previous)]
            restored = _restore(control, [*changed, *done])
            raise SwapError(f"{target.model}: {exc}{restored}", 1) from None
        now = control.served_config(target.model)
        outcomes.append(SwapOutcome(target.model, describe(now), time.monotonic() - started,
                                    changed=not same_config(now, previous)))
        done.append((target.model, previous))
        on_line(f"{target.model}: {'now serving' if outcomes[-1].changed else 'unchanged, serving'} "
                f"{outcomes[-1].serving} ({outcomes[-1].seconds:.1f} s)")
    note = stale_cache_note(served, outcomes)
    if note:
        on_line(note)
    return outcomes


def stale_cache_note(served: dict, outcomes: list[SwapOutcome]) -> str | None:
    """What to tell the user when a swapped model is a step of an ensemble with a response cache: Triton
    Triton keys a cached answer by model, version and inputs, not config, so an image the ensemble answered
    before the swap is answered from the cache with the previous config's answer (reproduced in
    tests/test_swap_live.py) until the cache evicts it or the server restarts. None otherwise."""
    changed = {outcome.model for outcome in outcomes if outcome.changed}
    cached = sorted(name for name, config in served.items() if config.response_cache.enable and (
        name in changed or {step.model_name for step in config.ensemble_scheduling.step} & changed))
    if not cached:
        return None
    return (f"note: the response cache of {', '.join(cached)} still answers inputs it saw before this swap with the "
            "previous config's answers (Triton keys a cached answer by model, version and inputs, not config) "
            "until it evicts them; a restart empties it")


def _wait_ready(control: ModelControl, models: list[str], deadline: float) -> None:
    while True:
        waiting = [model for model in models if not control.ready(model)]
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise SwapError(f"{', '.join(waiting)} not ready when the swap's time was up", 1)
        time.sleep(0.1)


def _unchanged(control: ModelControl, model: str, previous) -> bool:
    """True when `model` still serves `previous` (a refused load leaves the old config serving)."""
    try:
        return control.ready(model) and same_config(control.served_config(model), previous)
    except SwapError:
        return False


def _restore(control: ModelControl, previous: list[tuple[str, object]]) -> str:
    """Load each (model, config) back; what the message says about it ("" when there was none)."""
    if not previous:
        return "; nothing was changed"
    failed = []
    for model, config in previous:
        try:
            control.load(model, config)
        except SwapError:
            failed.append(model)
    if failed:
        return f"; could not put back the previous config of {', '.join(failed)}"
    return f"; put back on their previous configs: {', '.join(model for model, _ in previous)}"


def same_config(first, second) -> bool:
    """True when two ModelConfigs are the same, field for field (as the server reports them)."""
    from google.protobuf import json_format

    return json.dumps(json_format.MessageToDict(first), sort_keys=True) == \
        json.dumps(json_format.MessageToDict(second), sort_keys=True)
