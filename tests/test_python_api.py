"""The public Python API: what `resnet18_kit.client` exports, that each public name says what it takes and
gives, and that the example of docs/usage.md "Python API" runs as written against a real server and prints
what the clients answer."""
from __future__ import annotations

import inspect
import re
import subprocess
import sys

import resnet18_kit.client as client_package
from resnet18_kit.client import AsyncTritonClassifierClient, TritonClassifierClient
from resnet18_kit.client.samples import sample_photos
from resnet18_kit.contract import DEFAULT_URLS, REPO_ROOT

USAGE = REPO_ROOT / "docs" / "usage.md"
#: The methods a user calls to infer: their docstrings give arguments, return value and errors.
INFERENCE_METHODS = ("classify", "infer_tensor")


def python_api_example() -> str:
    """The first ```python block of the "## Python API" section of docs/usage.md."""
    text = USAGE.read_text()
    section = text[text.index("\n## Python API"):]
    section = section[:section.find("\n## ", 1) if "\n## " in section[1:] else len(section)]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "docs/usage.md: the Python API section has no ```python example"
    return match.group(1)


def test_the_package_exports_the_clients_their_answers_and_their_errors():
    names = set(client_package.__all__)
    assert {"TritonClassifierClient", "AsyncTritonClassifierClient", "Prediction", "RetryPolicy",
            "InferenceError", "QueueFullError", "DeadlineExceededError", "InvalidInputError"} <= names
    for name in names:
        assert getattr(client_package, name).__module__.startswith("resnet18_kit.client."), name


def test_every_public_name_and_method_has_a_docstring():
    undocumented = []
    for name in client_package.__all__:
        thing = getattr(client_package, name)
        if not (thing.__doc__ or "").strip():
            undocumented.append(name)
        if inspect.isclass(thing) and not issubclass(thing, Exception):
            for method_name, method in inspect.getmembers(thing, inspect.isfunction):
                if not method_name.startswith("_") and not (method.__doc__ or "").strip():
                    undocumented.append(f"{name}.{method_name}")
    assert not undocumented, f"no docstring: {undocumented}"


def test_the_inference_methods_state_arguments_returns_and_raises():
    for cls in (TritonClassifierClient, AsyncTritonClassifierClient):
        for method_name in INFERENCE_METHODS:
            doc = getattr(cls, method_name).__doc__
            missing = [part for part in ("Args:", "Returns:", "Raises:") if part not in doc]
            if method_name == "classify" or cls is TritonClassifierClient:
                assert not missing, f"{cls.__name__}.{method_name}: no {missing}"
            assert "[N, 1000]" in doc or method_name == "classify", f"{cls.__name__}.{method_name}: no shape"


def test_the_usage_example_is_at_most_15_lines_and_imports_only_the_public_package():
    code = python_api_example()
    lines = [line for line in code.splitlines() if line.strip()]
    assert len(lines) <= 15, f"{len(lines)} lines"
    imports = re.findall(r"^from (resnet18_kit\S*) import", code, re.M)
    assert imports == ["resnet18_kit.client"], imports


def test_the_usage_example_runs_against_a_server_and_prints_the_clients_answers(triton_server, tmp_path):
    photo = sample_photos()[0]
    (tmp_path / "cat.jpg").write_bytes(photo.read_bytes())
    code = python_api_example()
    for protocol in ("http", "grpc"):
        assert DEFAULT_URLS[protocol] in code, f"the example does not use the default {protocol} address"
        code = code.replace(DEFAULT_URLS[protocol], triton_server.config.url(protocol))
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    with TritonClassifierClient(triton_server.config.http_url) as client:
        expected = client.classify([photo.read_bytes()], top_k=3)[0]
    printed = result.stdout.splitlines()
    assert [line.rsplit(maxsplit=1)[0] for line in printed[:3]] == [p.label for p in expected], result.stdout
    assert [float(line.rsplit(maxsplit=1)[1]) for line in printed[:3]] == [
        round(p.probability, 3) for p in expected], result.stdout
    assert printed[3] == str([expected[0].label] * 2), result.stdout
