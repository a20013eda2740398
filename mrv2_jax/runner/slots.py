"""Stable per-request slots: a request keeps one row of the persistent tables for its life."""


class SlotAllocator:
    def __init__(self, num_slots: int):
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.slot_by_req: dict[str, int] = {}

    def allocate(self, req_id: str) -> int:
        if req_id in self.slot_by_req:
            raise ValueError(f"request {req_id!r} already holds slot {self.slot_by_req[req_id]}")
        if not self.free_slots:
            raise RuntimeError("no free request slot: the scheduler admitted more than max_num_seqs")
        slot = self.free_slots.pop()
        self.slot_by_req[req_id] = slot
        return slot

    def free(self, req_id: str) -> int | None:
        """Free `req_id`'s slot; unknown ids are fine (a request finished before it ran)."""
        slot = self.slot_by_req.pop(req_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        return slot

    def slot_of(self, req_id: str) -> int:
        return self.slot_by_req[req_id]

    def slots_of(self, req_ids) -> list[int]:
        """Every step's batch order: one C-level pass instead of a method call per row."""
        return list(map(self.slot_by_req.__getitem__, req_ids))
