"""Model loading (GGUF and Hugging Face directories), tokenizers, and the Llama-family decoders."""

from .gguf import cache_dir, default_model_path, export_hf_directory, load_gguf
from .loader import SUPPORTED_ARCHITECTURES, load_config, load_state_dict, resolve_model_dir

__all__ = ["cache_dir", "default_model_path", "export_hf_directory", "load_gguf", "SUPPORTED_ARCHITECTURES",
           "load_config", "load_state_dict", "resolve_model_dir"]
