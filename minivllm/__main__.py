"""`python -m minivllm ...`: the same commands as the `minivllm` console script."""
from minivllm.cli import main

if __name__ == "__main__":
    main()
