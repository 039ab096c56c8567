"""Which hosts train together, as they come and go: the coordinator, the leases, the
collective of an epoch's members and the start of a job."""
