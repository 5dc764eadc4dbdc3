"""Other frameworks' checkpoints: :mod:`tnlg.interop.megatron` (Megatron-LM, both ways). Hugging Face
GPT-2 interop lives in :mod:`tnlg.interop.hf`."""
