"""The vocabulary rows tensor parallel splits: Megatron's padding rule, shared by chapter 03's
vocabulary-parallel layers and the planner (pure Python, no torch)."""


def padded_vocab_size(vocab_size: int, tp: int, pad_to: int) -> int:
    """Vocabulary rows under tensor parallel: ``vocab_size`` when tp divides it, else rounded up
    to a multiple of pad_to x tp (Megatron's rule; 50257 at tp 2, pad_to 128 -> 50432)."""
    if vocab_size % tp == 0:
        return vocab_size
    return -(-vocab_size // (pad_to * tp)) * pad_to * tp
