"""CUDA path (issue 4): page-locking ring slots once, and device delivery.  Placeholder until
the CUDA work lands: SlotPinner.pin is a no-op."""


class SlotPinner:
    def pin(self, segment) -> None:
        pass
