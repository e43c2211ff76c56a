"""The torch API: attention, attention_varlen, attention_with_kvcache, the SDPA drop-in
and its routing, the Hugging Face integration, and the validation of their inputs.

Above serving (``flashtune.runtime``): a call is validated here, becomes a Problem
and is launched through a runtime plan."""
