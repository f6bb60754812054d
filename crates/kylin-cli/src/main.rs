//! The `kylin` command.

fn main() {
    println!("kylin");
}
