"""Signed, tamper-evident qualification receipts: DSSE, in-toto, Merkle log, SQL store."""
