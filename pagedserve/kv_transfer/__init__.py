"""KV connectors: how an engine saves the KV it computes and loads KV computed elsewhere, in vLLM V1's shape. One
object per side: the scheduler's (which prompt tokens can be loaded, what each step loads and saves) and the workers'
(the loads and saves themselves, around the forward pass)."""
