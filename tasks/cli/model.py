"""``rlhf-model``: use the aligned policy. ``export`` writes a Hugging Face folder with a model card, ``chat`` talks
to a model in the terminal, ``generate`` answers a file of prompts; ``score-pairs`` measures a reward model on
any pairs file (:mod:`tasks.cli.score_pairs`).

A model is a folder (``save_pretrained`` safetensors and tokenizer) or a registered version, ``models:/<name>@<alias>``
or ``models:/<name>/<version>``, downloaded from the project's MLflow registry and checked against its content hash.
Models load with the project's loaders (safetensors only, no remote code); prompts are encoded with the chat
template, with any control token written in a message kept as plain text (:func:`rlhf.data.chat.encode_messages`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import typer

from rlhf.files import atomic_write_text, write_json
from tasks.cli import run_command
from tasks.cli.versions import UserError, default_version, find_version, using_line
from tasks.kit.common import one_line, terminal_text
from tasks.kit.console import fit

app = typer.Typer(
    rich_markup_mode="markdown",  # the docstrings' `code` shown as code, not as backticks
    help="Use the aligned policy: export it (with a model card), chat with it, generate responses; "
    "score a reward model on a pairs file.",
)
MODEL_HELP = (
    "a folder, models:/NAME@ALIAS, models:/NAME/VERSION or models:/NAME/latest "
    "(default: the policy's champion, else its newest version, said which)"
)


def _project(project: str | None) -> str:
    """The project root (params.yaml + dvc.yaml, found up from here or ``project``); it becomes the current folder."""
    from tasks.kit.registry import _project as find

    root = os.path.abspath(find(project))
    os.chdir(root)
    return root


def _store():
    """The ``MlflowClient`` of the project's tracking store (the current folder is the project root), or None when
    the local store does not exist yet (looking never creates one)."""
    import mlflow

    from tasks.kit.runs import tracking_uri

    uri = tracking_uri()
    if uri.startswith("sqlite:///") and not os.path.exists(uri[len("sqlite:///") :]):
        return None
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")  # a server that is down fails in seconds
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    return mlflow.MlflowClient(tracking_uri=uri)


@contextlib.contextmanager
def model_folder(model: str | None, project: str | None) -> Iterator[tuple[str, Any]]:
    """Yield ``(folder, version)``: the folder itself (version None), or a registered version downloaded into a
    temporary folder (removed afterwards), after a line on stderr naming the version and its gate verdict. No
    ``model``: the policy's champion, else its newest version (:func:`tasks.cli.versions.default_version`).

    Raises:
        UserError: not a model folder, an unknown alias, nothing registered. RegistryError: the registry cannot
            give it.
    """
    if model is not None and not model.startswith("models:/"):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise UserError(f"{model}: not a model folder (no config.json); pass a folder or models:/<name>@<alias>")
        yield model, None
        return
    _project(project)
    client = _store()
    if client is None:
        raise UserError(
            f"{model or 'the policy'}: this project has no tracking store yet (no stage has run); pass a folder"
        )
    from tasks.kit.registry import download

    found = registered(model, client)
    with tempfile.TemporaryDirectory(prefix="rlhf-model-") as tmp:
        download(client, found, tmp)  # checked against the registered hash
        yield tmp, found


def policy_name() -> str | None:
    """``registry.policy_model`` of the project's params.yaml (the current folder), or None."""
    from tasks.kit.params import read_params, stage_params

    return stage_params("registry").get("policy_model") if "registry" in read_params() else None


def registered(model: str | None, client):
    """The version ``model`` (a ``models:/`` URI) names, or with None the policy's champion, else its newest
    version; says which on stderr, with its gate verdict.

    Raises:
        UserError: see :func:`tasks.cli.versions.find_version`, or no ``registry.policy_model`` for None.
    """
    note = ""
    if model is None:
        name = policy_name()
        if not name:
            raise UserError("params.yaml: no registry.policy_model to use the champion of; pass a model")
        found, note = default_version(client, name)
    else:
        found = find_version(model, client)
    typer.echo(fit(terminal_text(using_line(found, note))), err=True)
    return found


def load(folder: str, device: str = "auto"):
    """``(model, tokenizer)`` of a folder (:func:`rlhf.models.loading.load_causal_lm`,
    :func:`rlhf.models.loading.load_tokenizer`),
    the model in eval mode on ``device`` (``auto``: CUDA when present).

    Raises:
        UserError: the folder holds no causal LM (a reward model, say), or its tokenizer has no chat template.
    """
    import torch
    from transformers import AutoConfig

    from rlhf.models.loading import load_causal_lm, load_tokenizer

    architectures = AutoConfig.from_pretrained(folder, trust_remote_code=False).architectures or []
    if not any(name.endswith("ForCausalLM") for name in architectures):
        raise UserError(
            f"{folder}: not a causal language model ({', '.join(architectures) or 'no architecture'}); "
            "give a policy (e.g. models/policy)"
        )
    tokenizer = load_tokenizer(folder)
    if not tokenizer.chat_template:
        raise UserError(f"{folder}: the tokenizer has no chat template")
    place = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    return load_causal_lm(folder).to(place).eval(), tokenizer


def prompt_budget(model, max_new_tokens: int, max_prompt_tokens: int) -> int:
    """Tokens a prompt may take: ``max_prompt_tokens``, less when the model's positions leave less room.

    Raises:
        UserError: ``max_new_tokens`` leaves no room at all.
    """
    positions = getattr(model.config, "max_position_embeddings", None) or max_prompt_tokens + max_new_tokens
    budget = min(max_prompt_tokens, positions - max_new_tokens)
    if budget < 1:
        raise UserError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in {positions} positions")
    return budget


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]], budget: int) -> tuple[list[int], int]:
    """Token ids of a conversation with the generation header (the chat template), and how many of its oldest
    turns were dropped so it fits ``budget`` tokens; a system message stays. Returns ``(ids, dropped)``."""
    from rlhf.data.chat import encode_prompt

    system = [m for m in messages[:1] if m["role"] == "system"]
    turns, dropped = messages[len(system) :], 0
    ids = encode_prompt(tokenizer, system + turns, 1 << 30)
    while len(ids) > budget and any(m["role"] == "user" for m in turns[1:]):
        nxt = next(i for i, m in enumerate(turns) if i > 0 and m["role"] == "user")  # drop the oldest exchange
        turns, dropped = turns[nxt:], dropped + nxt
        ids = encode_prompt(tokenizer, system + turns, 1 << 30)
    return ids[-budget:], dropped


def read_prompts(path: str) -> list[dict[str, Any]]:
    """Rows of a prompts file: ``{"prompt": "text"}``, ``{"prompt": [messages]}`` (the pipeline's eval_prompts) or
    ``{"messages": [messages]}``; each gets ``messages`` ending with a user turn. Returns ``{"key", "value",
    "messages", "id"}`` per row.

    Raises:
        UserError: the first bad row, as ``FILE:LINE: rule``. FileNotFoundError: no such file.
    """
    from rlhf.data.formats import RowError, as_messages, check_prompt_visible
    from rlhf.data.reading import read_jsonl

    rows = []
    for line, row in read_jsonl(path):
        try:
            if isinstance(row, RowError):
                raise row
            if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
                raise RowError("a row is a JSON object with either 'prompt' (text or messages) or 'messages'")
            key = "prompt" if "prompt" in row else "messages"
            messages = as_messages(row[key], key, conversation=key == "messages")
            if not messages or messages[-1]["role"] != "user":
                raise RowError(f"'{key}' must end with a user turn")
            check_prompt_visible(messages, key)
        except RowError as err:
            raise UserError(f"{path}:{line}: {err}") from None
        rows.append({"key": key, "value": row[key], "messages": messages, "id": row.get("id")})
    if not rows:
        raise UserError(f"{path}: no prompts")
    return rows


def _fail(err: Exception) -> None:
    """End a command with one line on stderr and exit 1."""
    from tasks.cli.score_pairs import PairsError
    from tasks.kit.registry import RegistryError

    text = one_line(str(err)) or type(err).__name__
    if isinstance(err, FileNotFoundError) and err.filename:
        err, text = UserError(), f"{err.filename}: no such file or folder"
    elif isinstance(err, IsADirectoryError) and err.filename:
        err, text = UserError(), f"{err.filename}: is a folder, not a file"
    plain = isinstance(err, (UserError, RegistryError, PairsError))  # their lines already say what and where
    typer.echo(text if plain else f"error: {type(err).__name__}: {text}", err=True)
    raise typer.Exit(1)


@contextlib.contextmanager
def _one_line() -> Iterator[None]:
    """User errors (a bad argument, row, folder, registry reply) end the command with one line, no traceback; the
    libraries' progress bars (loading weights, downloading a version) and warnings stay quiet meanwhile
    (:func:`tasks.kit.console.quiet_libraries`)."""
    from tasks.kit.console import quiet_libraries

    quiet_libraries("rlhf-model")
    try:
        yield
    except (UserError, ValueError, OSError) as err:  # RegistryError is a ValueError; FileNotFoundError an OSError
        _fail(err)


def writable_file(path: str, option: str) -> None:
    """Refuse an output file whose folder does not exist, or that is a folder, before anything slow runs.

    Raises:
        UserError: names the option and the folder.
    """
    if os.path.isdir(path):
        raise UserError(
            f"{option} {path}: is a folder; name the file to write (e.g. {os.path.join(path, 'out.jsonl')})"
        )
    if not os.path.isdir(os.path.dirname(path)):
        raise UserError(f"{option} {path}: the folder {os.path.dirname(path)} does not exist")


@app.command()
def export(
    out: str = typer.Option(..., help="the folder to write (must not exist, or be empty)"),
    model: str = typer.Option(None, help=MODEL_HELP),
    dtype: str = typer.Option("bfloat16", help="the weights' dtype: bfloat16 (half the size) or float32"),
    project: str = typer.Option(None, help="the project folder (default: found from here)"),
) -> None:
    """Export a policy as a Hugging Face folder that transformers 4.57 and 5 load: safetensors, tokenizer with chat
    template, generation config and README.md, the model card. Written into a temporary folder beside --out and
    renamed at the end. Without --model: the policy's champion, else its newest version (said on stderr, with its
    gate verdict); a version that failed its gate is exported with a warning naming it, and its card says so."""
    from tasks.kit.model_card import card_facts, render_card
    from tasks.kit.params import stage_params
    from tasks.kit.portable import make_portable
    from tasks.kit.registry import DECISION_TAG, find_by_sha, folder_sha256

    out = os.path.abspath(out)
    with _one_line():
        if dtype not in ("bfloat16", "float32"):
            raise UserError(f"--dtype {dtype}: bfloat16 or float32")
        if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
            raise UserError(f"{out}: exists and is not an empty folder; choose another --out")
        given = os.path.abspath(model) if model and not model.startswith("models:/") else model
        project = _project(project)  # absolute from here on
        name = policy_name()
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with tempfile.TemporaryDirectory(dir=os.path.dirname(out), prefix=".export-") as tmp:
            with model_folder(given, project) as (source, found):
                sha, client = folder_sha256(source), _store()
                if found is None and client is not None and name:  # a folder: is its content a registered version?
                    found = find_by_sha(client, name, sha)
                policy, tokenizer = load(source, "cpu")
            import torch  # here, after the checks, as load's own imports
            from transformers import GenerationConfig

            from rlhf.models.loading import save_tokenizer

            staged = os.path.join(tmp, "export")
            generation = stage_params("generation")
            policy.generation_config = GenerationConfig(
                do_sample=True,
                temperature=generation.get("temperature"),
                top_k=0,
                top_p=1.0,
                max_new_tokens=generation.get("max_new_tokens"),
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id,
            )
            policy.to(getattr(torch, dtype)).save_pretrained(staged, safe_serialization=True)
            save_tokenizer(tokenizer, staged)
            make_portable(staged)
            if given is None or given.startswith("models:/"):
                origin = given or f"models:/{found.name}/{found.version}"
            else:
                origin = f"the folder {shown_path(given, project)}"
            render_card(card_facts(sha, found, client, origin, dtype)).save(os.path.join(staged, "README.md"))
            umask = os.umask(0)
            os.umask(umask)
            for entry in os.listdir(staged):  # transformers writes the weights 0600: a shared folder is readable
                os.chmod(os.path.join(staged, entry), 0o666 & ~umask)
            if os.path.isdir(out):
                os.rmdir(out)  # empty (checked above): the rename takes its place
            os.rename(staged, out)
    typer.echo(f"exported {given or f'{found.name} version {found.version}'} to {out}")
    decision = found.tags.get(DECISION_TAG) if found is not None else None
    if decision == "fail":
        typer.echo(
            fit(
                f"warning: {found.name} version {found.version} failed its gate ({DECISION_TAG} = fail; its reasons: "
                f"rlhf-registry status policy): the folder says so in its card"
            ),
            err=True,
        )


def shown_path(path: str, project: str) -> str:
    """``path`` as written for others: relative to the project when inside it, else its last folder name."""
    inside = os.path.commonpath([os.path.abspath(path), project]) == project
    return os.path.relpath(path, project) if inside else os.path.basename(os.path.normpath(path))


def find_version_or_none(uri: str, client):
    """:func:`find_version`, or None when no version holds the alias (or the name is not registered)."""
    try:
        return find_version(uri, client)
    except UserError:
        return None


@app.command()
def chat(
    model: str = typer.Argument(None, help=MODEL_HELP),
    max_new_tokens: int = typer.Option(128, min=1, help="tokens per answer at most"),
    temperature: float = typer.Option(0.7, min=1e-3, help="sampling temperature"),
    greedy: bool = typer.Option(False, help="greedy decoding instead of sampling"),
    system: str = typer.Option(None, help="a system message that opens the conversation"),
    seed: int = typer.Option(0, help="the sampling seed"),
    max_prompt_tokens: int = typer.Option(1024, min=1, help="the oldest turns are dropped beyond this"),
    project: str = typer.Option(None, help="the project folder, for models:/ URIs (default: found from here)"),
) -> None:
    """Chat in the terminal with the model's chat template. /reset clears the conversation; /exit or Ctrl-D ends."""
    with _one_line(), model_folder(model, project) as (folder, found):
        policy, tokenizer = load(folder)
        budget = prompt_budget(policy, max_new_tokens, max_prompt_tokens)
    import torch  # here, after the checks: a bad argument is reported in a second

    from tasks.kit.served import respond

    torch.manual_seed(seed)
    opening = [{"role": "system", "content": system}] if system else []
    messages = list(opening)
    who = model or f"models:/{found.name}/{found.version}"
    typer.echo(f"chatting with {who}; /reset clears the conversation, /exit or Ctrl-D ends")
    while True:
        try:
            text = typer.prompt("you", default="", show_default=False, prompt_suffix="> ")
        except typer.Abort:  # Ctrl-D (EOF) or Ctrl-C
            typer.echo()
            break
        if text.strip() in ("/exit", "/quit"):
            break
        if text.strip() == "/reset":
            messages = list(opening)
            typer.echo("(conversation cleared)")
            continue
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        ids, dropped = chat_prompt_ids(tokenizer, messages, budget)
        if dropped:
            messages = opening + messages[len(opening) + dropped :]
            typer.echo(f"(the {dropped} oldest messages no longer fit {budget} tokens and were dropped)")
        answer = respond(policy, tokenizer, [ids], max_new_tokens, temperature, greedy)[0]
        messages.append({"role": "assistant", "content": answer})
        typer.echo(f"assistant> {answer}")


@app.command()
def generate(
    model: str = typer.Argument(None, help=MODEL_HELP),
    prompts: str = typer.Option(..., help='jsonl: {"prompt": text or messages} or {"messages": [...]} rows'),
    out: str = typer.Option(..., help="jsonl written atomically: each row's prompt or messages and its response"),
    batch_size: int = typer.Option(8, min=1, help="prompts generated together"),
    max_new_tokens: int = typer.Option(128, min=1, help="tokens per response at most"),
    temperature: float = typer.Option(0.7, min=1e-3, help="sampling temperature"),
    greedy: bool = typer.Option(False, help="greedy decoding instead of sampling"),
    seed: int = typer.Option(0, help="the sampling seed"),
    max_prompt_tokens: int = typer.Option(1024, min=1, help="longer prompts lose their oldest tokens"),
    project: str = typer.Option(None, help="the project folder, for models:/ URIs (default: found from here)"),
) -> None:
    """Generate one response per row of a prompts file (rows checked before the model loads)."""
    prompts, out = os.path.abspath(prompts), os.path.abspath(out)
    with _one_line():
        rows = read_prompts(prompts)
        writable_file(out, "--out")
        with model_folder(model, project) as (folder, _):
            policy, tokenizer = load(folder)
        import torch  # here, after the checks: a bad argument is reported in a second

        from rlhf.data.chat import encode_prompt
        from tasks.kit.served import respond

        budget = prompt_budget(policy, max_new_tokens, max_prompt_tokens)
        torch.manual_seed(seed)
        ids = [encode_prompt(tokenizer, row["messages"], budget) for row in rows]
        order = sorted(range(len(rows)), key=lambda i: len(ids[i]))  # similar lengths together: less padding
        answers: dict[int, str] = {}
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            texts = respond(policy, tokenizer, [ids[i] for i in batch], max_new_tokens, temperature, greedy)
            answers.update(zip(batch, texts, strict=True))
        lines = [
            json.dumps(
                {
                    **({"id": row["id"]} if row["id"] is not None else {}),
                    row["key"]: row["value"],
                    "response": answers[i],
                },
                ensure_ascii=False,
            )
            for i, row in enumerate(rows)
        ]
        atomic_write_text(out, "\n".join(lines) + "\n")
    typer.echo(f"wrote {len(rows)} response{'' if len(rows) == 1 else 's'} to {out}")


@app.command("score-pairs")
def score_pairs(
    model: str = typer.Argument(..., help="a reward-model folder, models:/NAME@ALIAS, models:/NAME/VERSION or /latest"),
    pairs: list[str] = typer.Argument(
        ..., help="jsonl[.gz] files of preference rows: any path or URL the prepare stage reads; several: a block each"
    ),
    fmt: str = typer.Option("auto", "--format", help="the rows' format: auto, hh, pairs, conversational, ranking"),
    mapping: str = typer.Option(None, help='JSON renaming the rows\' keys first, e.g. \'{"question": "prompt"}\''),
    max_length: int = typer.Option(
        None,
        min=1,
        help="tokens per prompt + response (default: the model's reward_max_length, else 1024, "
        "within the tokenizer's and the model's limits)",
    ),
    batch_size: int = typer.Option(8, min=1, help="sequences scored together"),
    max_rows: int = typer.Option(None, min=1, help="read at most this many rows (default: all)"),
    skip_bad_rows: bool = typer.Option(False, help="leave out rows that do not parse (counted) instead of stopping"),
    json_out: str = typer.Option(None, "--json", help="also write the metrics to this JSON file (atomically)"),
    kind: list[str] = typer.Option(
        None,
        help="the kind of each file's rows, in order (e.g. --kind helpful --kind harmless); default: each "
        "file's name when there are several, none for one file; a row's own --kind-field wins",
    ),
    kind_field: str = typer.Option("kind", help="the row key holding its kind (prepared splits have it)"),
    project: str = typer.Option(None, help="the project folder, for models:/ URIs (default: found from here)"),
) -> None:
    """Score a reward model on pairs files with the reward stage's own measure and print every figure: accuracy
    with its Wilson interval, the chosen-shorter/longer accuracies, calibration, margin, the empty-answer check;
    then the same per kind of data (a row's kind field, --kind, or one kind a file when several are given) and
    per source. Rows are checked before the model loads; a row that does not parse stops it with one line
    (file:line: rule), or with --skip-bad-rows is left out and counted."""
    from tasks.cli import score_pairs as scoring

    if json_out is not None:
        json_out = os.path.abspath(json_out)  # a models:/ URI makes the project folder current
    with _one_line():
        if json_out is not None:
            writable_file(json_out, "--json")
        kinds = scoring.file_kinds(pairs, kind)
        examples, rows, left_out = [], 0, []
        for path, file_kind in zip(pairs, kinds, strict=True):
            read = scoring.read_pairs(
                path, fmt, scoring.parse_mapping(mapping), max_rows, skip_bad_rows, file_kind, kind_field
            )
            examples, rows, left_out = examples + read[0], rows + read[1], left_out + read[2]
        with model_folder(model, project) as (folder, _):
            reward_model, tokenizer, length = scoring.load_reward_model(folder, max_length)
        metrics = scoring.score(reward_model, tokenizer, examples, length, batch_size)
        if json_out is not None:
            write_json(json_out, scoring.json_metrics(metrics))
    typer.echo(f"{model} on {', '.join(pairs)}: {len(examples)} pairs from {rows} rows, max length {length} tokens")
    if left_out:
        typer.echo(f"left out {len(left_out)} rows that do not parse, the first {left_out[0]}")
    for line in scoring.metric_lines(metrics) + scoring.part_blocks(metrics):
        typer.echo(line)
    if json_out is not None:
        typer.echo(f"wrote the metrics to {json_out}")


@app.command()
def serve(
    model: str = typer.Argument(None, help=MODEL_HELP.replace("a folder, ", "")),
    port: int = typer.Option(5001, min=1, max=65535, help="the port to listen on"),
    host: str = typer.Option("127.0.0.1", help="the address to listen on (0.0.0.0: every interface)"),
    project: str = typer.Option(None, help="the project folder (default: found from here)"),
) -> None:
    """Serve a registered version with `mlflow models serve` (REST: POST /invocations), from any shell: this
    environment's tools come first on the PATH (MLflow starts `uvicorn` by name), the project's tracking store is
    the one read, and the version is named by its number so it serves what the first line says."""
    from tasks.kit.runs import tracking_uri

    with _one_line():
        if model is not None and not model.startswith("models:/"):
            raise UserError(f"{model}: serve takes a registered version (models:/...); a folder has no MLflow Model")
        _project(project)
        client = _store()
        if client is None:
            raise UserError("this project has no tracking store yet (no stage has run)")
        found = registered(model, client)
        tools = os.path.dirname(sys.executable)
        env = {**os.environ, "PATH": os.pathsep.join([tools, os.environ.get("PATH", "")])}
        env["MLFLOW_TRACKING_URI"] = tracking_uri()
        uri = f"models:/{found.name}/{found.version}"
        command = [os.path.join(tools, "mlflow"), "models", "serve", "-m", uri, "--env-manager", "local"]
    typer.echo(f"serving {uri} on http://{host}:{port}/invocations (Ctrl-C stops it)", err=True)
    os.execvpe(command[0], [*command, "-h", host, "-p", str(port)], env)


def console() -> None:
    """The console command (pyproject's scripts): :data:`app` through :func:`tasks.cli.run_command`."""
    run_command(app)


if __name__ == "__main__":
    console()
