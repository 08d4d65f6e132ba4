"""Stand-ins for the FlashAttention extensions, for CPU tests of the arguments the backends pass."""


class RecordingFA2Extension:
    """FlashAttention-2's ``flash_attn_2_cuda`` as far as ``varlen_fwd`` goes: records each call's
    arguments and returns ``out`` (the 4th) untouched."""

    def __init__(self):
        self.calls = []

    def varlen_fwd(self, *args):
        self.calls.append(args)
        return (args[3],)
