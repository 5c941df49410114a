"""Model checkpoints for the examples and the tests (not part of the attention core): the embedded SmolLM2-135M
converted from its GGUF file, and random-initialised Llamas of any head layout (``dcp_plugin.models.embedded``)."""
