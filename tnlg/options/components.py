"""The options of ``tnlg pretrain``, one dataclass per component; each validates itself in
``__post_init__`` (a :class:`tnlg.errors.UserError` naming the flag), as :class:`tnlg.config.GPTConfig`
does. Defaults are Megatron-LM's where Megatron has one (:mod:`tnlg.commands.pretrain_args` adds the built-in
job's and the published recipes)."""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from ..config import LR_DECAY_STYLES, GPTConfig, pretrain_fields
from ..errors import UserError
from .checks import nonnegative_int, optional_positive_int, positive_int
from .fields import check_declared, flag_of, option
from ..layout import FLAGS, check_positive

__all__ = ["ModelOptions", "ScheduleOptions", "ParallelOptions", "DataOptions", "PrecisionOptions",
           "LoggingOptions", "CheckpointOptions", "AdapterOptions", "DEFAULT_NPROC", "COMPONENTS"]

DEFAULT_NPROC = 4  # local processes when not under torchrun and --nproc-per-node is not given


def _model_options() -> type:
    """``ModelOptions``: the :class:`GPTConfig` fields declared ``pretrain`` (the declaration is the
    config's; here only ``tnlg pretrain``'s default where it differs), each checked as the config checks
    it, with a :class:`UserError` naming the flag."""
    hints = typing.get_type_hints(GPTConfig)
    specs = []
    for f in pretrain_fields():
        meta = {k: v for k, v in f.metadata.items() if k != "pretrain_default"}
        default = f.metadata.get("pretrain_default", f.default)
        specs.append((f.name, hints[f.name], dataclasses.field(default=default, metadata=meta)))

    def __post_init__(self):
        check_declared(type(self), {f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    return dataclasses.make_dataclass("ModelOptions", specs, namespace={
        "__post_init__": __post_init__, "__module__": __name__,
        "__doc__": "The model's shape and architecture (with ``--preset``: the preset's); declared by "
                   ":class:`tnlg.config.GPTConfig`."})


if TYPE_CHECKING:
    class ModelOptions:
        """What the type checker sees of the dataclass made below: GPTConfig's ``pretrain`` fields."""

        def __init__(self, **fields: Any) -> None: ...

        def __getattr__(self, name: str) -> Any: ...
else:
    ModelOptions = _model_options()


@dataclass
class ScheduleOptions:
    """Batch, run length, learning-rate schedule and AdamW."""
    micro_batch_size: int = option(8, help="samples per rank per micro step")
    global_batch_size: Optional[int] = option(
        None, help="samples per iteration = micro x DP x accumulation steps", every="micro batch x DP")
    train_iters: Optional[int] = option(None, every="none: required")
    lr: float = option(6e-4, help="peak learning rate")
    min_lr: float = option(0.0)
    lr_warmup_iters: int = option(0, help="linear warmup from 0 over this many iterations")
    lr_decay_iters: Optional[int] = option(None, help="decay ends here; --min-lr after", every="--train-iters")
    lr_decay_style: str = option("linear", choices=list(LR_DECAY_STYLES))
    weight_decay: float = option(0.01, help="AdamW decay on matrices (2-D parameters) only")
    clip_grad: float = option(1.0, help="clip by the global norm across TP and DP (0: off)")
    adam_beta1: float = option(0.9)
    adam_beta2: float = option(0.999)
    adam_eps: float = option(1e-8)
    calculate_per_token_loss: bool = option(False, help="the loss is the global batch's token sum over its "
                                            "counted tokens, not the mean of the micro batches' means")

    def __post_init__(self):
        if self.train_iters is None:
            raise UserError("--train-iters is required for a run on your own data (--data-path) or a --preset "
                            "without a recipe, as in Megatron-LM: the built-in job's 300 iterations suit only the "
                            "built-in job. The learning-rate schedule (decay over --train-iters) follows it.")
        positive_int(self, "micro_batch_size")
        optional_positive_int(self, "global_batch_size")
        positive_int(self, "train_iters")
        nonnegative_int(self, "lr_warmup_iters")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise UserError(f"--lr-decay-style must be {', '.join(LR_DECAY_STYLES[:-1])} or {LR_DECAY_STYLES[-1]}, "
                            f"got {self.lr_decay_style!r}.")
        optional_positive_int(self, "lr_decay_iters")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise UserError(f"--lr must be a positive number, got {self.lr!r}.")
        if not (isinstance(self.min_lr, (int, float)) and 0 <= self.min_lr <= self.lr):
            raise UserError(f"--min-lr must be between 0 and --lr ({self.lr}), got {self.min_lr!r}.")
        self.lr_schedule()  # refuses a warmup that does not end before the decay

    def lr_schedule(self):
        """Megatron's learning-rate schedule (:class:`tnlg.optim.LRSchedule`) of these options: over the
        count of optimizer steps taken, decaying until ``--lr-decay-iters``, else ``--train-iters``."""
        from ..optim.schedule import LRSchedule  # (torch: not imported for --help)
        return LRSchedule(max_lr=self.lr, min_lr=self.min_lr, warmup_iters=self.lr_warmup_iters,
                          decay_iters=int(self.lr_decay_iters or self.train_iters or 0),
                          decay_style=self.lr_decay_style)


@dataclass
class ParallelOptions:
    """The layout: TP inside groups, ZeRO data parallelism across them, and the local processes (checked
    against the processes by :class:`~tnlg.layout.ParallelDims`, whose flags these are)."""
    tensor_model_parallel_size: int = option(1, flags=FLAGS["tp"],
                                             help="TP size (any size up to the head count)")
    pipeline_model_parallel_size: int = option(1, flags=FLAGS["pp"],
                                               help="pipeline stages: the layers split over this many ranks "
                                               "(world = PP x TP x DP); see docs/pipeline.md for what runs with it")
    context_parallel_size: int = option(1, flags=FLAGS["cp"],
                                        help="context-parallel ranks: each sequence split into 2 x CP chunks, "
                                        "attention by a ring (world = TP x CP x DP; docs/context_parallel.md)")
    expert_model_parallel_size: int = option(1, flags=FLAGS["ep"],
                                             help="with --num-experts: expert-parallel size, the experts split over "
                                             "this many ranks carved from DP x CP (megatron-core's MoE parallel "
                                             "folding; docs/moe.md)")
    expert_tensor_parallel_size: Optional[int] = option(
        None, help="with --num-experts: the TP size of the experts' weights (megatron-core's flag); tnlg splits "
        "them over TP as the dense MLP, so only that size runs", every="the TP size")
    pipeline_schedule: str = option("1f1b", choices=["1f1b", "gpipe", "interleaved"],
                                    help="with --pp > 1: torch's Schedule1F1B, ScheduleGPipe or "
                                    "ScheduleInterleaved1F1B")
    num_layers_per_virtual_pipeline_stage: Optional[int] = option(
        None, help="layers per model chunk of the interleaved schedule (selects --pipeline-schedule interleaved)")
    decoder_first_pipeline_num_layers: Optional[int] = option(None, help="layers of the first stage (the one "
                                                              "with the embedding)", every="an even split")
    decoder_last_pipeline_num_layers: Optional[int] = option(None, help="layers of the last stage (the one with "
                                                             "the LM head and loss)", every="an even split")
    sequence_parallel: bool = option(False, help="with TP > 1: split the activations between the TP regions "
                                     "along the sequence (LayerNorm, dropout, residual on 1/TP of the tokens; "
                                     "all-gather/reduce-scatter instead of all-reduce; any sequence length)")
    zero_stage: int = option(1, choices=[0, 1, 2, 3], help="0: all-reduce; 1: optimizer states partitioned; "
                             "2: + gradients; 3: + parameters (2/3 via FSDP2)")
    zero_impl: str = option("tnlg", choices=["tnlg", "deepspeed"], help="ZeRO implementation: tnlg (our own "
                            "for 0/1, FSDP2 for 2/3) or deepspeed (DeepSpeed's ZeRO 1-3 over our DP group; "
                            "optional: pip install --no-build-isolation \"deepspeed>=0.14\")")
    nproc_per_node: Optional[int] = option(None, flags=FLAGS["nproc"], help="launch this many local processes (torch's elastic "
                                           "launcher) unless already under torchrun",
                                           every=f"one per GPU when GPUs are present, else {DEFAULT_NPROC}")
    max_restarts: int = option(0, help="with --nproc-per-node: restart the group this many times after a "
                               "failure (resuming from --save)")
    distributed_timeout_minutes: float = option(10, help="a hung collective fails after this long")
    bucket_size_mb: float = option(25.0, cli=False)  # gradient bucket size (config file only)

    def __post_init__(self):
        check_positive(tp=self.tensor_model_parallel_size, pp=self.pipeline_model_parallel_size,
                       cp=self.context_parallel_size, ep=self.expert_model_parallel_size)
        optional_positive_int(self, "num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
                              "decoder_last_pipeline_num_layers")
        if self.pipeline_schedule not in ("1f1b", "gpipe", "interleaved"):
            raise UserError(f"--pipeline-schedule must be 1f1b, gpipe or interleaved, got {self.pipeline_schedule!r}.")
        if self.num_layers_per_virtual_pipeline_stage is not None and self.pipeline_schedule == "1f1b":
            self.pipeline_schedule = "interleaved"  # Megatron: a virtual-stage size selects interleaving
        if self.zero_stage not in (0, 1, 2, 3):
            raise UserError(f"--zero-stage must be 0, 1, 2 or 3, got {self.zero_stage!r}.")
        if self.zero_impl not in ("tnlg", "deepspeed"):
            raise UserError(f"--zero-impl must be tnlg or deepspeed, got {self.zero_impl!r}.")
        optional_positive_int(self, "nproc_per_node")


@dataclass
class DataOptions:
    """The corpus and how samples are cut from it (all of it must match when resuming)."""
    data_path: Optional[list[str]] = option(None, help="PREFIX, or weights and prefixes: 0.7 A 0.3 B (default: "
                                            "the built-in corpus)")
    split: str = option("969,30,1", help="train,valid,test weights by documents, e.g. 949,50,1", must_match=True)
    seed: int = option(1234, help="seed of the sample order, the initial weights and dropout", must_match=True)
    tokenizer_model: Optional[str] = option(None, help="SentencePiece .model or a GPT-2 BPE folder")
    data_cache_path: Optional[str] = option(None, help="where index arrays are cached when the data folder is "
                                            "read-only, and the tokenized --sft-data-path rows (default "
                                            "$TNLG_CACHE/sft)")
    eod_mask_loss: bool = option(False, must_match=True)
    reset_position_ids: bool = option(False, must_match=True)
    reset_attention_mask: bool = option(False, must_match=True)
    sft_data_path: Optional[str] = option(None, help="fine-tuning rows instead of --data-path: a JSONL or Parquet "
                                          "file or a datasets folder of {prompt, completion} or {messages} rows "
                                          "(docs/finetune.md); the loss counts the completions", must_match=True)
    sft_valid_data_path: Optional[str] = option(None, help="fine-tuning rows to validate on (the completions' "
                                                "per-token loss)", every="none: no validation",
                                                must_match=True)
    packing: bool = option(True, negative="--no-packing", flags=("--packing",), must_match=True,
                           help="with --sft-data-path: one sample per sequence, padded (padding never "
                                "counted); by default samples are packed into sequences, each seeing only "
                                "itself, its positions restarting at 0")
    sft_loss_on_prompt: bool = option(False, must_match=True, help="with --sft-data-path: the loss counts the "
                                      "prompts' tokens too")

    def __post_init__(self):
        if self.data_path is not None and self.sft_data_path is not None:
            raise UserError(f"--data-path {' '.join(self.data_path)} and --sft-data-path {self.sft_data_path!r} "
                            f"both give the training data; give one: --data-path for pretraining documents "
                            f"(tnlg preprocess), --sft-data-path for prompt/completion or chat rows.")
        if self.sft_valid_data_path is not None and self.sft_data_path is None:
            raise UserError(f"--sft-valid-data-path {self.sft_valid_data_path!r} needs --sft-data-path (the "
                            f"fine-tuning rows to train on).")
        if self.data_path is not None:  # X.bin, X.idx and X all mean the dataset X: recorded as X
            from ..data.gpt_dataset import normalize_data_path
            self.data_path = normalize_data_path(self.data_path)

    def tokenizer_path(self) -> str:
        """``--tokenizer-model`` of a run that trains (``--data-path`` requires it; the built-in job's is set
        when its corpus is prepared)."""
        if self.tokenizer_model is None:
            raise UserError("training needs --tokenizer-model (the tokenizer the data was preprocessed with).")
        return self.tokenizer_model

    def check_files(self) -> None:
        """The datasets and the tokenizer can be read (reads their headers; imports the data modules)."""
        if self.data_path is not None:
            from ..data.gpt_dataset import parse_data_path
            from ..data.indexed import IndexedDataset
            prefixes, _ = parse_data_path(self.data_path)
            for prefix in prefixes:
                IndexedDataset(prefix)  # refuses missing / corrupt files with a clear error
            if self.tokenizer_model is None:
                raise UserError("--data-path needs --tokenizer-model (the tokenizer the data was preprocessed "
                                "with).")
        for flag, path in (("--sft-data-path", self.sft_data_path), ("--sft-valid-data-path",
                                                                     self.sft_valid_data_path)):
            if path is not None and not os.path.exists(path):
                raise UserError(f"{flag} {path!r} does not exist; give a JSONL or Parquet file or a datasets "
                                f"folder of fine-tuning rows.")
        if self.sft_data_path is not None and self.tokenizer_model is None:
            raise UserError("--sft-data-path needs --tokenizer-model (or a --load checkpoint that records its "
                            "tokenizer).")
        if self.tokenizer_model is not None:
            from ..data.tokenizer import load_tokenizer
            load_tokenizer(self.tokenizer_model)  # refuses a missing or unreadable tokenizer with a clear error


@dataclass
class PrecisionOptions:
    """Mixed precision, the device, activation recomputation."""
    bf16: bool = option(False, help="ZeRO mixed precision: bf16 parameters and gradients (2 + 2 bytes per "
                        "parameter), fp32 master weights and Adam moments for the owned 1/dp slice")
    fp16: bool = option(False, help="as --bf16 in fp16, with dynamic loss scaling (GPUs only)")
    accumulate_allreduce_grads_in_fp32: bool = option(
        False, help="with --bf16/--fp16: keep an fp32 gradient buffer (accumulation over micro batches and the "
        "DP reduction in fp32; 2 + 4 bytes per parameter); ZeRO stages 0 and 1")
    device: Optional[str] = option(None, choices=["cpu", "cuda"], help="where to train (default: cuda when a "
                                   "GPU is present, else cpu); one process per GPU")
    recompute_activations: bool = option(False, help="activation checkpointing per block; the same as "
                                         "--recompute-granularity full (Megatron-LM maps it to selective)")
    recompute_granularity: Optional[str] = option(
        None, choices=["full", "selective"], help="recompute activations in backward instead of keeping them: "
        "full = every transformer block from its input (2 s b h bytes per layer kept, one more forward); "
        "selective = the attention core only (softmax and dropout, the 5 a s^2 b term; a few %% more FLOPs); "
        "default: keep everything")
    compile: bool = option(False, help="torch.compile every transformer block (dropout draws as in eager mode); "
                           "if the compiler toolchain fails, training runs eager and a warning says why")

    def __post_init__(self):
        # --recompute-activations is --recompute-granularity full; afterwards both say the same
        if self.recompute_granularity not in (None, "full", "selective"):
            raise UserError(f"--recompute-granularity must be full or selective, got {self.recompute_granularity!r}.")
        if self.recompute_activations and self.recompute_granularity == "selective":
            raise UserError("--recompute-activations (full recomputation of every block) contradicts "
                            "--recompute-granularity selective (the attention core only); give one of them.")
        if self.recompute_activations:
            self.recompute_granularity = "full"
        self.recompute_activations = self.recompute_granularity == "full"

    def check_device(self) -> None:
        """The precision flags fit each other and the device (``--device cuda`` needs a GPU: imports torch)."""
        if self.bf16 and self.fp16:
            raise UserError("--bf16 and --fp16 are exclusive: pick one.")
        from ..parallel.state import pick_device
        device = pick_device(self.device)  # --device cuda without a GPU is refused here
        if self.fp16 and device.type != "cuda":
            raise UserError("--fp16 needs a GPU: fp16 matrix multiplies are unusably slow on CPUs. Use --bf16 "
                            "(bf16 parameters, fp32 master weights) or fp32 (the default) on this machine.")
        if self.accumulate_allreduce_grads_in_fp32 and not (self.bf16 or self.fp16):
            raise UserError("--accumulate-allreduce-grads-in-fp32 needs --bf16 or --fp16: in fp32 training the "
                            "gradients are fp32 already.")


# how the sample at the end of a run is drawn (tnlg.training.loop), said in --help
SAMPLE_TOP_K = 40
SAMPLE_TEMPERATURE = 0.8


@dataclass
class LoggingOptions:
    """The log, validation, metrics and the sample at the end."""
    log_interval: int = option(100)
    eval_interval: int = option(1000, help="validation every N iterations (and before the first; 0: off)")
    eval_iters: Optional[int] = option(100, help="global batches per validation (0: no validation; none in a "
                                       "config file: the whole validation set once)")
    metrics_file: Optional[str] = option(None, help="JSON Lines metrics (default SAVE/metrics.jsonl)")
    plot: bool = option(True, negative="--no-plot", help="no loss-curve PNG at the end")
    peak_tflops: Optional[float] = option(None, help="per-rank peak for MFU (default: measured at start)")
    sample_prompt: str = option("", help=f"prompt of the sample printed at the end ('' for none), drawn with "
                                         f"top-k {SAMPLE_TOP_K}, temperature {SAMPLE_TEMPERATURE} and the run's "
                                         f"--seed", every="none")
    sample_tokens: int = option(48)
    tensorboard_dir: Optional[str] = option(None, help="write TensorBoard event files here (rank 0): the scalars "
                                            "of metrics.jsonl; needs the tensorboard package")
    tensorboard_log_interval: int = option(1, help="training scalars to TensorBoard and W&B every N iterations")
    wandb_project: Optional[str] = option(None, help="log the same scalars to this Weights & Biases project "
                                          "(rank 0; needs the wandb package; WANDB_MODE=offline: no account)")
    wandb_exp_name: Optional[str] = option(None, help="the W&B run's name", every="the --save folder's name")
    wandb_save_dir: Optional[str] = option(None, help="where W&B writes its local files",
                                           every="SAVE/wandb, else ./wandb")

    def __post_init__(self):
        positive_int(self, "log_interval", "tensorboard_log_interval")
        nonnegative_int(self, "eval_interval")
        if self.eval_iters is not None:  # None: the whole validation set once (tnlg finetune's default)
            nonnegative_int(self, "eval_iters")

    def check_loggers(self) -> None:
        """The logging backends asked for can run: their package is installed and their folders can be
        created. Writes nothing and imports neither package."""
        if self.tensorboard_dir is not None:
            _check_installed("tensorboard", f"--tensorboard-dir {self.tensorboard_dir!r}")
            _check_folder("--tensorboard-dir", self.tensorboard_dir)
        if self.wandb_project is None:
            given = [flag_of(n) for n in ("wandb_exp_name", "wandb_save_dir") if getattr(self, n) is not None]
            if given:
                raise UserError(f"{' and '.join(given)} configure{'s' if len(given) == 1 else ''} the Weights & "
                                f"Biases run that --wandb-project "
                                f"starts; without --wandb-project nothing goes to W&B. Add --wandb-project NAME or "
                                f"drop {' and '.join(given)}.")
            return
        _check_installed("wandb", f"--wandb-project {self.wandb_project!r}", " To log without an account, set "
                         "WANDB_MODE=offline (the run is then written under --wandb-save-dir only).")
        if self.wandb_save_dir is not None:
            _check_folder("--wandb-save-dir", self.wandb_save_dir)


def _check_installed(package: str, what: str, more: str = "") -> None:
    import importlib.util
    if importlib.util.find_spec(package) is None:
        raise UserError(f"{what} needs the {package} package, which is not installed: pip install {package} (or "
                        f"pip install -e \".[loggers]\"), or drop the flag.{more}")


def _check_folder(flag: str, path: str) -> None:
    """``path`` is a folder, or can be made one: its nearest existing ancestor is a writable folder."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{flag} {path!r} is a file, not a folder; it must be a folder (existing, or one to be "
                        f"created). Give another path, or move the file away.")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UserError(f"{flag} {path!r} cannot be created: {existing!r} is a file, not a folder.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path!r} cannot be created: {existing!r} is not writable. Give a writable "
                        f"folder.")


@dataclass
class CheckpointOptions:
    """Where checkpoints go, how often, and where a run resumes from."""
    save: Optional[str] = option(
        None, help="checkpoint directory, also for metrics.jsonl and the loss plot; resumed from when it holds a "
        "checkpoint. Without it: the built-in job saves to a new folder under runs/ (pretrain-DATE-TIME; under "
        "torchrun pretrain-RUN_ID), a run with --load saves back into the root it loaded from, any other run "
        "saves nothing (and says so at start and at the end)")
    save_interval: Optional[int] = option(None, help="save every N iterations (always at the end and on "
                                          "Ctrl-C or SIGTERM)", every="only at the end")
    exit_interval: Optional[int] = option(None, help="stop after each iteration divisible by N, saving it when the "
                                          "run has a save root, and exit 0 (Megatron-LM's --exit-interval: a job "
                                          "of fixed length in a queue); the same command resumes it",
                                          every="never")
    load: Optional[str] = option(None, help="resume from this checkpoint (a root: its latest iteration; or an "
                                 "iter_* directory); without --save, later checkpoints go into the same root")
    keep_last: Optional[int] = option(None, help="keep only the last K checkpoints")
    finetune: bool = option(False, help="start from the weights of --load only (Megatron's --finetune): "
                            "iteration 0, a new optimizer and LR schedule, the RNGs seeded; a --save that "
                            "already holds this run's checkpoint resumes it instead")
    use_checkpoint_args: bool = option(False, help="take the model shape, data, tokenizer, layout (TP, ZeRO), "
                                       "schedule, precision and intervals from the options the checkpoint "
                                       "recorded (--load, else --save; not paths, process count or device); "
                                       "flags given override them, and each override is printed")

    def __post_init__(self):
        optional_positive_int(self, "save_interval", "keep_last", "exit_interval")
        if self.finetune and self.load is None:
            raise UserError("--finetune starts from the weights of a checkpoint, but no --load is given. Give "
                            "--load DIR (a tnlg checkpoint; `tnlg finetune` also takes a Hugging Face folder or "
                            "a Megatron-LM checkpoint).")

    def check_load(self) -> None:
        if self.load is not None and not os.path.isdir(self.load):
            raise UserError(f"--load {self.load!r} is not a directory.")


@dataclass
class AdapterOptions:
    """Low-rank adapters (LoRA) on a frozen base, ``tnlg finetune`` only: PEFT's ``LoraConfig`` fields
    (:mod:`tnlg.adapters.lora`, :mod:`tnlg.interop.peft`)."""
    lora_rank: Optional[int] = option(None, help="train rank-R adapters (LoRA, PEFT's r) on the targeted linear "
                                      "layers of a frozen base instead of every weight (tnlg finetune)",
                                      every="no adapters: every weight trains", metavar="R")
    lora_alpha: float = option(8.0, help="the adapters' scale alpha: each adds (alpha / R) B A x (PEFT's "
                               "lora_alpha)")
    lora_dropout: float = option(0.0, help="dropout on the adapters' input (PEFT's lora_dropout)")
    lora_target_modules: Optional[list[str]] = option(
        None, help="the layers that get adapters, by PEFT's names: GPT-2 c_attn, c_proj, c_fc (attn.c_proj / "
        "mlp.c_proj: one of the two); the Llama layout q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
        "down_proj; all-linear: every one", every="PEFT's for the family: c_attn (GPT-2), q_proj v_proj (Llama)",
        metavar="MODULE")
    use_rslora: bool = option(False, help="scale by alpha / sqrt(R) (rank-stabilised LoRA) instead of alpha / R")
    load_adapter: Optional[str] = option(None, help="start from the adapters of PEFT's folder DIR "
                                         "(adapter_config.json + adapter_model.safetensors; its rank, alpha, "
                                         "dropout and targets), on the base of --load", metavar="DIR")

    def __post_init__(self):
        optional_positive_int(self, "lora_rank")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise UserError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout!r}.")
        if self.lora_alpha <= 0:
            raise UserError(f"--lora-alpha must be positive, got {self.lora_alpha!r}.")
        given = [flag_of(n) for n, default in (("lora_alpha", 8.0), ("lora_dropout", 0.0),
                                               ("lora_target_modules", None), ("use_rslora", False))
                 if getattr(self, n) != default]
        if given and self.load_adapter is not None:
            raise UserError(f"--load-adapter {self.load_adapter!r} brings its own rank, alpha, dropout and targets "
                            f"(adapter_config.json); drop {', '.join(given)}.")
        if given and self.lora_rank is None:
            raise UserError(f"{', '.join(given)} set{'s' if len(given) == 1 else ''} up adapters, but no "
                            "--lora-rank R (or --load-adapter DIR) asks for them. Add --lora-rank R (16 is "
                            "common) or drop the flag.")
        if self.load_adapter is not None and self.lora_rank is not None:
            raise UserError(f"--load-adapter {self.load_adapter!r} brings its own rank, alpha and targets "
                            f"(adapter_config.json); drop --lora-rank {self.lora_rank}.")

    @property
    def enabled(self) -> bool:
        return self.lora_rank is not None or self.load_adapter is not None


# (attribute of the composed options, class, --help group), in --help order
COMPONENTS = (("model", ModelOptions, "model"), ("schedule", ScheduleOptions, "batch and schedule"),
              ("parallel", ParallelOptions, "parallelism"), ("data", DataOptions, "data"),
              ("precision", PrecisionOptions, "precision and memory"),
              ("logging", LoggingOptions, "logging, evaluation, checkpoints"),
              ("checkpoint", CheckpointOptions, "logging, evaluation, checkpoints"),
              ("adapters", AdapterOptions, "low-rank adapters (tnlg finetune)"))
