"""The KV evictors (DESIGN section 3), kvpress style: one per file, each the subclass of its torch-free settings
(`kvrescue.evictor_catalogue`) that scores; the machinery they share in `base`, the attention scores several use in
`attention_scores`, and the registry of implementations by name in `registry`."""
