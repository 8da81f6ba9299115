"""Policy-lab traces: what the draft proposes, how confident its head is and how many drafts the target accepts
at every position of recorded greedy requests, so any policy, batch size and cost model can be replayed
through the engine's scheduler without running either model (`trace`, `record`, `workload`)."""
