"""Real `vllm serve` command lines run as `loraserve serve` against a live server, only paths and ports
changed (the model becomes a tiny random one of the same kind).

Sources: the issue's Gemma-2 script; GitHub scripts WohimLee/vLLM-Tutorial (6.openai_server/src/
launch_vllm.sh), lijiawei20161002/password_locking (local_inference_setup/serve.sh), thomas-roth/iTRAP
(start_vlm_server.sh), PLMQ2785/Gemma3Serving (serve.sh) and three unnamed public LoRA scripts; vLLM's
documentation (OpenAI-compatible server, LoRA adapters, chat templates, --config files). Two lines are
composed from documented flags: a server behind a TLS proxy and one on a Unix socket.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import transformers
from support.live_serve import live_serve
from support.serve_process import free_port

PROMPT = [5, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def files(tiny_model: Any, hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A tiny Llama that allows 32k tokens (the lines ask for up to 8192), two adapters, a Gemma-2."""
    from loraserve.demo.random_model import save_peft_adapter

    root = tmp_path_factory.mktemp("vllm-lines")
    llama = shutil.copytree(tiny_model("llama"), root / "models" / "llama")
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32768}))
    for seed, name in enumerate(("sql", "chat")):
        save_peft_adapter(hf_model(tiny_model("llama")), str(root / "home" / "adapters" / name), 40 + seed,
                          str(llama), r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    gemma = transformers.Gemma2Config(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=4, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    transformers.Gemma2ForCausalLM(gemma).save_pretrained(root / "models" / "gemma2")
    return {"llama": str(llama), "home": str(root / "home"), "gemma2": str(root / "models" / "gemma2"),
            "root": str(root)}


def base_url(server: Any, scheme: str = "http") -> str:
    return f"{scheme}://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


def complete(url: str, model: str, **kwargs: Any) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=30, **kwargs)


def test_the_gemma2_script_from_the_issue(files: dict[str, str], monkeypatch, capsys) -> None:
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    monkeypatch.chdir(files["home"])  # --lora-modules lora=./output/lora_model is relative
    shutil.copytree(Path(files["home"]) / "adapters" / "sql", Path(files["home"]) / "output" / "lora_model",
                    dirs_exist_ok=True)
    argv = [files["llama"], "--gpu-memory-utilization=1", "--port", str(free_port()), "--served-model-name=gemma",
            "--trust-remote-code", "--max-model-len", "8192", "--disable-log-requests", "--enable-lora",
            "--lora-modules", "lora=./output/lora_model", "--max-lora-rank", "64"]
    with live_serve(argv, monkeypatch) as server:
        url = base_url(server)
        assert {m["id"] for m in httpx.get(url + "/v1/models").json()["data"]} == {"gemma", "lora"}
        assert complete(url, "lora").status_code == 200 and complete(url, "gemma").status_code == 200
        reload = {"lora_name": "lora", "lora_path": "./output/lora_model", "load_inplace": True}
        assert httpx.post(url + "/v1/load_lora_adapter", json=reload).status_code == 200
    assert "--gpu-memory-utilization 1 has no effect here" in capsys.readouterr().err


@pytest.mark.parametrize(
    "line",
    [
        # WohimLee/vLLM-Tutorial: python -m vllm.entrypoints.openai.api_server --model models/Qwen3-8B ...
        "--model {llama} --max-model-len 8192 --gpu-memory-utilization 0.85 --max-num-seqs 64 "
        "--tensor-parallel-size 1 --port {port}",
        # lijiawei20161002/password_locking
        "--model {llama} --max-model-len 2048 --gpu-memory-utilization 0.9 --port {port}",
        # a public Skywork-o1 serving script
        "{llama} --max-model-len 8192 --disable-log-requests --tensor-parallel-size 1 "
        "--served-model-name Skywork-o1-Open-Llama-3.1-8B --gpu-memory-utilization 0.95 --port {port} "
        "--enable-prefix-caching",
        # vLLM docs, OpenAI-compatible server (with the issue's other rejected flags)
        "{llama} --dtype auto --api-key token-abc123 --port {port} --swap-space 16 --enable-chunked-prefill "
        "--uvicorn-log-level warning --disable-log-stats --disable-frontend-multiprocessing",
    ],
)
def test_base_model_lines(line: str, files: dict[str, str], monkeypatch) -> None:
    argv = line.format(port=free_port(), **files).split()
    with live_serve(argv, monkeypatch) as server:
        url = base_url(server)
        key = argv[argv.index("--api-key") + 1] if "--api-key" in argv else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        name = httpx.get(url + "/v1/models", headers=headers).json()["data"][0]["id"]
        assert complete(url, name, headers=headers).status_code == 200
        if key:
            assert complete(url, name).status_code == 401


@pytest.mark.parametrize(
    "line, adapters",
    [
        # a public Llama-2 multi-LoRA script (python -m vllm.entrypoints.openai.api_server ...)
        ("--model {llama} --host 127.0.0.1 --port {port} --enable-lora --disable-log-requests "
         "--gpu-memory-utilization 0.85 --lora-modules lora-1={home}/adapters/sql lora-2={home}/adapters/chat "
         "--max-loras 4 --max-cpu-loras 32 --tensor-parallel-size 1 --enforce-eager", ["lora-1", "lora-2"]),
        # vLLM docs, LoRA adapters: --lora-modules sql-lora=$HOME/... (here a literal ~, expanded by loraserve)
        ("{llama} --enable-lora --lora-modules sql-lora=~/adapters/sql --port {port}", ["sql-lora"]),
        # vLLM docs, LoRA adapters: the JSON form
        ('{llama} --enable-lora --port {port} --lora-modules '
         '{{"name":"sql-lora","path":"~/adapters/sql","base_model_name":"{llama}"}}', ["sql-lora"]),
    ],
)
def test_lora_lines(line: str, adapters: list[str], files: dict[str, str], monkeypatch) -> None:
    monkeypatch.setenv("HOME", files["home"])
    argv = line.format(port=free_port(), **files).split()
    with live_serve(argv, monkeypatch) as server:
        url = base_url(server)
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]][1:] == adapters
        assert all(complete(url, name).status_code == 200 for name in adapters)


def test_runtime_lora_updating_line(files: dict[str, str], monkeypatch) -> None:
    # A public script: VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve Qwen/Qwen3-8B --enable-lora ...
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    monkeypatch.setenv("HOME", files["home"])
    argv = [files["llama"], "--enable-lora", "--max-lora-rank", "16", "--max-loras", "4", "--port", str(free_port()),
            "--gpu-memory-utilization", "0.85"]
    with live_serve(argv, monkeypatch) as server:
        url = base_url(server)
        load = {"lora_name": "policy", "lora_path": "~/adapters/sql"}
        assert httpx.post(url + "/v1/load_lora_adapter", json=load).status_code == 200
        first = complete(url, "policy").json()["choices"][0]["text"]
        again = httpx.post(url + "/v1/load_lora_adapter", json={**load, "lora_path": "~/adapters/chat"})
        assert again.status_code == 400 and again.json()["error"]["type"] == "InvalidUserInput"
        inplace = {**load, "lora_path": "~/adapters/chat", "load_inplace": True}
        assert httpx.post(url + "/v1/load_lora_adapter", json=inplace).status_code == 200
        assert complete(url, "policy").json()["choices"][0]["text"] != first


def test_chat_template_and_config_file_lines(files: dict[str, str], tmp_path: Path, monkeypatch) -> None:
    # vLLM docs: vllm serve <model> --chat-template ./path-to-chat-template.jinja; vllm serve --config config.yaml
    (tmp_path / "template.jinja").write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    port = free_port()
    (tmp_path / "config.yaml").write_text(
        f"model: {files['llama']}\nport: {port}\nuvicorn-log-level: info\nmax-model-len: 4096\n"
        "tensor-parallel-size: 1\nenable-prefix-caching: true\n"
    )
    monkeypatch.chdir(tmp_path)
    argv = ["--config", "config.yaml", "--chat-template", "./template.jinja", "--response-role", "bot",
            "--generation-config", "vllm"]
    with live_serve(argv, monkeypatch) as server:
        assert server.servers[0].sockets[0].getsockname()[1] == port
        body = {"model": files["llama"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        reply = httpx.post(base_url(server) + "/v1/chat/completions", json=body, timeout=30)
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["role"] == "bot"
        assert reply.json()["usage"]["prompt_tokens"] == 2  # "hi\n" under the template from the file


def test_behind_a_tls_proxy(files: dict[str, str], tmp_path: Path, monkeypatch) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl to make a certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
    argv = [files["llama"], "--port", str(free_port()), "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
            "--root-path", "/llm", "--allowed-origins", '["https://app.example"]', "--allow-credentials",
            "--enable-request-id-headers", "--disable-fastapi-docs", "--disable-uvicorn-access-log",
            "-tp", "1", "--kv-cache-dtype", "auto", "--max-num-batched-tokens", "2048"]
    with live_serve(argv, monkeypatch) as server:
        url = base_url(server, "https")
        reply = complete(url, files["llama"], verify=False, headers={"X-Request-Id": "abc"})
        assert reply.status_code == 200 and reply.headers["x-request-id"] == "abc"
        preflight = httpx.options(url + "/v1/completions", verify=False, headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        assert preflight.headers["access-control-allow-credentials"] == "true"
        assert httpx.get(url + "/docs", verify=False).status_code == 404
        # The proxy strips /llm; the app knows its public prefix (ASGI root_path), as in vLLM.
        assert server.config.root_path == "/llm"


def test_gemma2_without_a_tokenizer_on_a_unix_socket(files: dict[str, str], tmp_path: Path, monkeypatch) -> None:
    sock = str(tmp_path / "serve.sock")
    argv = [files["gemma2"], "--uds", sock, "--skip-tokenizer-init", "--max-logprobs", "50", "--load-format",
            "safetensors", "--config-format", "hf", "--enforce-eager", "--return-tokens-as-token-ids"]
    with live_serve(argv, monkeypatch):
        client = httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://serve")
        body = {"model": files["gemma2"], "prompt": PROMPT, "max_tokens": 2, "logprobs": 30, "ignore_eos": True}
        reply = client.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert len(reply.json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= 30
        assert client.post("/v1/completions", json={**body, "prompt": "text"}).status_code == 400


@pytest.mark.parametrize(
    "line, error",
    [
        # thomas-roth/iTRAP: two GPUs
        ("--model {llama} --host 0.0.0.0 --port 8000 --tensor-parallel-size 2 --gpu-memory-utilization 0.33 "
         "--max-model-len 32768 --served-model-name qwen2-vl", "--tensor-parallel-size 2 cannot be honoured"),
        # PLMQ2785/Gemma3Serving: a quantized checkpoint
        ("--model {llama} --quantization compressed-tensors --dtype bfloat16 --max-model-len 4096 "
         "--gpu-memory-utilization 0.9 --trust-remote-code --port 8030", "--quantization 'compressed-tensors' is not"),
        # a public Llama-3.1 LoRA script on two GPUs
        ("{llama} --enable-lora --lora-modules fa=/x --max-lora-rank 256 --dtype auto --max-model-len 2048 "
         "--tensor-parallel-size 2 --swap-space 8 --gpu-memory-utilization 0.8", "--tensor-parallel-size 2"),
        # a public Qwen3 script with tool calling and a reasoning parser
        ("{llama} --max-model-len 8192 --reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser hermes "
         "--enable-lora", "is not supported"),
    ],
)
def test_lines_that_cannot_be_honoured_fail_in_one_line(line: str, error: str, files: dict[str, str], capsys) -> None:
    from loraserve.entrypoints import cli

    with pytest.raises(SystemExit) as info:
        cli.main(["serve", *line.format(**files).split()])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if ": notice: " not in line]
    assert info.value.code == 2 and len(err) == 1 and error in err[0], err
