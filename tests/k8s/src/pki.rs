//! The cluster's keys, made with the machine's `openssl`: a CA, the API
//! server's serving certificate (for 127.0.0.1, 10.0.2.2 — the host as a test-bed guest sees it — and the in-cluster names), and the
//! ServiceAccount token signing key pair. Clients authenticate with bearer
//! tokens: the components with static tokens (`--token-auth-file`), the drivers
//! with ServiceAccount tokens the API server issues.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Result;

use crate::proc::run;

/// The files of the cluster's keys.
pub struct Pki {
    /// The CA's certificate.
    pub ca: PathBuf,
    /// The API server's serving certificate.
    pub serving_cert: PathBuf,
    /// Its key.
    pub serving_key: PathBuf,
    /// The ServiceAccount token signing key.
    pub sa_key: PathBuf,
    /// Its public key.
    pub sa_pub: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) -> Result<String> {
    run(Command::new("openssl").current_dir(dir).args(args))
}

impl Pki {
    /// Makes the keys in `dir`.
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];
        openssl(
            dir,
            &[
                &["req", "-x509", "-nodes", "-days", "2"][..],
                &ec,
                &[
                    "-keyout",
                    "ca.key",
                    "-out",
                    "ca.crt",
                    "-subj",
                    "/CN=vfio-sandbox-test-ca",
                ],
            ]
            .concat(),
        )?;
        openssl(
            dir,
            &[
                &["req", "-nodes"][..],
                &ec,
                &[
                    "-keyout",
                    "apiserver.key",
                    "-out",
                    "apiserver.csr",
                    "-subj",
                    "/CN=kube-apiserver",
                ],
            ]
            .concat(),
        )?;
        std::fs::write(
            dir.join("apiserver.ext"),
            "basicConstraints=CA:FALSE\n\
             keyUsage=critical,digitalSignature,keyEncipherment\n\
             extendedKeyUsage=serverAuth\n\
             subjectAltName=IP:127.0.0.1,IP:10.0.2.2,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,\
             DNS:kubernetes.default,DNS:kubernetes.default.svc\n",
        )?;
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                "apiserver.csr",
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                "apiserver.ext",
                "-out",
                "apiserver.crt",
            ],
        )?;
        openssl(
            dir,
            &[
                "genpkey",
                "-algorithm",
                "RSA",
                "-pkeyopt",
                "rsa_keygen_bits:2048",
                "-out",
                "sa.key",
            ],
        )?;
        openssl(dir, &["pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub"])?;
        Ok(Self {
            ca: dir.join("ca.crt"),
            serving_cert: dir.join("apiserver.crt"),
            serving_key: dir.join("apiserver.key"),
            sa_key: dir.join("sa.key"),
            sa_pub: dir.join("sa.pub"),
        })
    }
}

/// Writes a kubeconfig for `server` that trusts `ca` and sends `token`.
pub fn kubeconfig(path: &Path, server: &str, ca: &Path, token: &str) -> Result<()> {
    let config = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": {
            "server": server,
            "certificate-authority": ca,
        }}],
        "users": [{"name": "test", "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
        "current-context": "test",
    });
    std::fs::write(path, serde_json::to_vec_pretty(&config)?)?;
    Ok(())
}
