"""`qualify run`: validate the request, boot the engine, run the checks, judge, sign and store the receipt."""
