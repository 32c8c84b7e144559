"""The reference GLM-5.3-style hybrid engine (KDA + paged attention) behind the qualify protocol."""
