//! Generates the v1beta1 messages and both services from api.proto.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc);
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_with_config(config, &["api.proto"], &["."])?;
    println!("cargo:rerun-if-changed=api.proto");
    Ok(())
}
