"""GPT-2 through Hugging Face transformers' attention interface (gpt2, hf_attention), version glue (hfcompat)
and rotary position embeddings (rope).

Used in: 02 (03, 04 and 07 build on gpt2).
"""
