//! The files prepare writes for a claim: the CDI spec and the device metadata.
