"""Other frameworks' checkpoints: :mod:`tnlg.interop.megatron` (Megatron-LM, both ways). Hugging Face
GPT-2, Llama and Qwen2: :mod:`tnlg.interop.hf` (models and folders), :mod:`tnlg.interop.hf_reader` (reading a
folder: exactly transformers' model, or one paragraph), :mod:`tnlg.interop.hf_files` (its weight files),
:mod:`tnlg.interop.hf_fields` (every config field's list), :mod:`tnlg.interop.hf_mapping` and
:mod:`tnlg.interop.hf_llama` (configs and state dicts)."""
