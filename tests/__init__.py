"""dcp-triton's test suite: unit/ and integration/ run on CPU (`make test`), gpu/ on a CUDA GPU (`pytest -m gpu`);
helpers/ holds what their modules share. A package, so every module imports the others by name (`tests.helpers...`)."""
